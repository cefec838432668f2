"""The sha256 of each file of a folder, recorded when the folder is written and checked before
its files are trusted: a training checkpoint and RUN/final carry `checksums.json` (train writes
it, a resume and doel-export check it), as the shards' meta.json and a bundle's manifest record
theirs.

    checksums.json = {"format": "doel-checksums", "version": 1,
                      "files": {"model.safetensors": {"bytes": 123, "sha256": "ab…"}, …}}

Paths are relative to the folder, "/"-separated; the record does not list itself, nor files
written after it (a checkpoint's model card). Hashing runs on several threads (hashlib lets go
of the GIL on large buffers), so a folder is checked at the disk's speed or the cores', not
one core's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NAME = "checksums.json"
FORMAT = "doel-checksums"
VERSION = 1
THREADS = 4  # files hashed at once: enough to keep a disk busy, few beside a training run
# The one flag of every command that skips these checks. Not --no-verify, its old spelling:
# "verify" is doel-train's correctness suite (--skip-verify).
FLAG = "--no-checksums"
OLD_FLAG = "--no-verify"


class _Renamed(argparse.Action):
    """An old spelling of a flag, refused in one line naming the new one (exit 2)."""

    def __init__(self, option_strings, dest, new: str, **kw):
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def add_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """--no-checksums (`args.no_checksums`), and its old spelling refused naming it."""
    parser.add_argument(FLAG, action="store_true", help=help)
    parser.add_argument(OLD_FLAG, action=_Renamed, new=FLAG, dest="_renamed")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_files(paths: list[Path]) -> list[str]:
    """The sha256 of each path, in order, several at a time."""
    if len(paths) <= 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(min(THREADS, len(paths))) as pool:
        return list(pool.map(sha256_file, paths))


def record(folder: str | os.PathLike) -> dict:
    """What checksums.json holds for every file now under `folder` (subfolders too)."""
    folder = Path(folder)
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != NAME)
    digests = hash_files(paths)
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": d}
        for p, d in zip(paths, digests)
    }
    return {"format": FORMAT, "version": VERSION, "files": files}


def recorded(folder: str | os.PathLike, error: type[Exception] = ValueError) -> dict | None:
    """The files table of `folder`'s checksums.json, or None when it has none (written before
    doel recorded hashes). A record that cannot be read raises `error`."""
    path = Path(folder) / NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        ok = data.get("format") == FORMAT and all(
            isinstance(v["bytes"], int) and isinstance(v["sha256"], str) for v in files.values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise error(f"{path} is damaged (not a {FORMAT} record); {_AGAIN}")
    return files


_AGAIN = f"copy the folder again, or pass {FLAG} to use it as it is"


def verify(
    folder: str | os.PathLike,
    error: type[Exception] = ValueError,
    names: list[str] | None = None,
    hint: str = _AGAIN,
) -> dict[str, str]:
    """Check the files checksums.json lists (only `names` of them, when given) against it:
    sizes first, then contents. Raises `error` with one line naming the first file that
    differs and saying `hint`. Returns {name: sha256} of the files checked ({} without a
    record), for a caller that reports their hashes too."""
    folder = Path(folder)
    files = recorded(folder, error)
    if files is None:
        return {}
    wanted = [n for n in files if names is None or n in names]
    for name in wanted:
        path = folder / name
        if not path.is_file():
            raise error(f"{path} is missing; {NAME} lists it; {hint}")
        size = path.stat().st_size
        if size != files[name]["bytes"]:
            raise error(
                f"{path} is truncated or damaged: {size:,} bytes where {NAME} records "
                f"{files[name]['bytes']:,}; {hint}"
            )
    digests = hash_files([folder / n for n in wanted])
    for name, got in zip(wanted, digests):
        if got != files[name]["sha256"]:
            raise error(
                f"{folder / name} does not match the sha256 {NAME} records for it: damaged since "
                f"it was written; {hint}"
            )
    return dict(zip(wanted, digests))
