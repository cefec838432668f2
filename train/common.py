"""Small helpers shared by the training stage: user-facing errors, hashing, atomic writes."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from doel.contracts.checksums import sha256_file  # noqa: F401 (the stage's name for it)

# The built-in sample (Bangla and English text, conversations), shipped inside doel.train: the
# demo and the recipe's dry run read it from here too.
SAMPLE_DIR = Path(__file__).resolve().parent / "sample"


class DoelError(Exception):
    """An error caused by the user's input; its message says what to do. The CLI prints it
    without a traceback."""


class Damaged(DoelError):
    """A file whose bytes differ from the hash recorded when it was written (a shard, a
    checkpoint): never trained on, resumed from or exported silently."""


class Interrupted(DoelError):
    """Ctrl-C stopped the work; the message says what was kept and how to go on. The CLI
    prints it without a traceback and exits 130 (128 + SIGINT), as a shell reports it."""


def _create_temp(path: Path) -> tuple[int, str]:
    """A new file beside `path`, opened for writing. Unlike `mkstemp` (always 0600), it is
    created with mode 0666 so the kernel applies the user's umask (and any default ACL): the
    renamed file has the permissions a plain `open(path, "w")` would give it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: a reader never sees
    half a file, and a killed process leaves the old file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
