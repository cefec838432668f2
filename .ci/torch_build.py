"""Which torch build a fresh virtualenv gets (`make demo`, `make test`), said in one line.

On Linux, PyPI's torch is the CUDA build: about 6 GB of virtualenv with its nvidia/ and triton
packages, useless on a machine without an NVIDIA GPU (issue 38: a 6.1 GB venv for a demo that
runs on the CPU). So, before the project is installed:
- an NVIDIA GPU (nvidia-smi lists one): pip's own choice, the CUDA build;
- no GPU, and what pip would install already is a CPU build (a `+cpu` version: a local wheel
  on disk, or CI's PIP_CONSTRAINT pin of one): that, unchanged;
- no GPU otherwise on Linux: a CPU build on this machine's disk (pip's find-links), else the
  one from PyTorch's CPU index, installed alone first so the project's install finds torch
  satisfied;
- macOS and Windows: PyPI's torch, which has no CUDA libraries there.

Run with the virtualenv's interpreter: `VENV/bin/python .ci/torch_build.py` (what pip
installs into is that interpreter's environment). `--dry-run` says what it would do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SPEC = "torch>=2.4"  # pyproject.toml's train extra


def gpu_name(which=shutil.which, run=subprocess.run) -> str | None:
    """The first NVIDIA GPU nvidia-smi lists, or None (no nvidia-smi, no GPU, a driver error)."""
    if which("nvidia-smi") is None:
        return None
    try:
        out = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x for x in out.stdout.splitlines() if x.startswith("GPU ")]
    return lines[0].split(" (UUID")[0] if out.returncode == 0 and lines else None


def planned_version(python: str = sys.executable, run=subprocess.run, local=False) -> str | None:
    """The torch version pip would install here, from its configured sources and constraints
    (`pip install --dry-run --report`), or with `local` from local files alone (find-links,
    no index, no dependencies); None when it cannot say."""
    # --no-deps: torch's own wheel is the question, and resolving the rest takes long
    cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps"]
    cmd += ["--quiet", "--no-index"] if local else ["--quiet"]
    try:
        out = run([*cmd, "--report", "-", SPEC], capture_output=True, text=True, timeout=600)
        report = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    for item in report.get("install", []):
        if item.get("metadata", {}).get("name", "").lower() == "torch":
            return item["metadata"]["version"]
    return None


def choose(
    gpu: str | None, platform: str, planned: str | None, local: str | None = None
) -> tuple[list[str] | None, str]:
    """(pip arguments that install torch first, or None to leave it to pip; the line that says
    which build and why). `planned`: the version pip would pick; `local`: the one on disk."""
    if gpu:
        return None, f"torch: the CUDA build (PyPI's), for the NVIDIA GPU found ({gpu})"
    if not platform.startswith("linux"):
        return None, f"torch: PyPI's build, CPU only on {platform}"
    why = "no NVIDIA GPU found; PyPI's Linux torch is the 6 GB CUDA build"
    if planned and "+cpu" in planned:
        return None, f"torch {planned}: the CPU build pip finds here ({why})"
    if local and "+cpu" in local:
        return [f"torch=={local}"], f"torch {local}: the CPU build on this machine's disk ({why})"
    return ["--index-url", CPU_INDEX, SPEC], f"torch: the CPU build from {CPU_INDEX} ({why})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="say the choice, install nothing")
    args = ap.parse_args(argv)
    gpu = gpu_name()
    planned = local = None
    if not gpu and sys.platform.startswith("linux"):
        planned = planned_version()
        local = None if planned and "+cpu" in planned else planned_version(local=True)
    extra, line = choose(gpu, sys.platform, planned, local)
    print(line, flush=True)
    if extra is None or args.dry_run:
        return 0
    cmd = [sys.executable, "-m", "pip", "install", *extra]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
