"""Small helpers of the export stage: the user-facing error, hashing, and the staging folder that
makes a bundle appear whole or not at all.

The export stage imports nothing from `train/`: stages talk only through files, so a bundle can
be made from any Hugging Face folder on a machine that has only the export extra.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from doel.contracts import read_json
from doel.contracts.checksums import sha256_file
from doel.contracts.lock import FolderLock


class ExportError(Exception):
    """An error caused by the user's input or a failed check; its message says what to do. The
    command line prints it without a traceback."""


def file_table(folder: Path) -> dict[str, dict]:
    """Size and sha256 of every file in the folder (flat: a bundle has no subfolders)."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def fresh_dir(parent: Path, prefix: str, suffix: str) -> Path:
    """A new, empty folder in `parent`. Unlike `mkdtemp` (always 0700), it is made with mode 0777
    so the kernel applies the user's umask: a bundle renamed from it can be served by another
    account exactly when a folder made by `mkdir` could."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            path.mkdir(mode=0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {parent}")


def keep_umask(folder: Path) -> None:
    """Give everything in `folder` the mode `open` / `mkdir` would give it under the user's
    umask: some writers make theirs private (onnx 1.2x creates external weights 0600). `folder`
    was made by `fresh_dir`, so its own mode is 0777 & ~umask, read without touching the
    process-wide umask."""
    dir_mode = stat.S_IMODE(folder.stat().st_mode)
    for p in folder.rglob("*"):
        if not p.is_symlink():
            p.chmod(dir_mode if p.is_dir() else dir_mode & 0o666)


def is_bundle(folder: Path) -> bool:
    """Whether `folder` holds a manifest.json that doel-export wrote."""
    manifest = read_json(folder / "manifest.json")
    return manifest is not None and manifest.get("format") == "doel-export"


def check_out(out: Path, force: bool) -> None:
    """Refuse an `out` that exists, unless `force` and it is empty or a bundle: --force replaces a
    bundle, never a folder of someone's other files (nor a file)."""
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise ExportError(f"{out} exists; pass --force to replace it or choose another --out")
    if not out.is_dir():
        raise ExportError(
            f"{out} is not a folder; --force replaces only a bundle: choose another --out"
        )
    if any(out.iterdir()) and not is_bundle(out):
        raise ExportError(
            f"{out} is not an export bundle (no doel-export manifest.json) and not empty; --force "
            "replaces only a bundle: choose another --out, or empty or remove it yourself"
        )


@contextlib.contextmanager
def staging(out: Path, force: bool) -> Iterator[Path]:
    """Yield an empty hidden folder beside `out`; when the block succeeds, it becomes `out`.

    On any error the staging folder is removed and `out` is left as it was, so a failed export
    never leaves a partial bundle. With `force`, an existing `out` is replaced only after the new
    bundle is complete (moved aside, the new one renamed in, the old one deleted). The bundle and
    its files get the modes the user's umask gives, so another account can serve it. `out` is
    locked throughout (doel/contracts/lock.py): a second export into it stops, naming this one,
    and the staging folders that killed exports left beside it are removed.
    """
    with FolderLock(out, "doel-export", ExportError):
        check_out(out, force)
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp = fresh_dir(out.parent, f".{out.name}.", ".tmp")
        try:
            yield tmp
            keep_umask(tmp)
            old = None
            if out.exists():
                old = fresh_dir(out.parent, f".{out.name}.", ".old")
                os.replace(out, old / out.name)
            os.replace(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def remove_stale(out: Path) -> list[Path]:
    """Remove the staging folders (`.OUT.<hex>.tmp`) of exports into `out` that were killed.
    Called with `out` locked: every export takes the lock before it makes its staging folder,
    so any found now belongs to a process that has died. Returns what was removed."""
    name = re.compile(rf"^\.{re.escape(out.name)}\.[0-9a-f]{{12}}\.tmp$")
    stale = [p for p in out.parent.iterdir() if name.match(p.name) and p.is_dir()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale
