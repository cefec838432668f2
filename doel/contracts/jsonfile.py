"""Reading a JSON record that may not be there: the one reader every stage uses for its records
(run marks, cards, a checkpoint's side files), so "no such file" means one thing everywhere.

A missing file is None. A file that is there but cannot be read, or holds anything but a JSON
object, is None too by default: those records are hints or caches (a checkpoint's side files, the
verified-run record, the launch marker other nodes poll while it is rewritten), and a damaged one
costs a default or a redone check, never a stopped run. `strict=True` makes it an error (a
ValueError naming the file) for records a damaged copy must not pass for absent: the pipeline's
stage marks, on whose absence it deletes or redoes work, and what a model card or the run's
summary reports."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path, *, strict: bool = False) -> dict | None:
    """The JSON object in `path`; None where there is no such file. A damaged one (unreadable,
    not UTF-8 JSON, not an object) is None too, or with `strict` an OSError or ValueError."""
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        if strict:
            raise
        return None
    except ValueError as e:  # not UTF-8, or not JSON
        if strict:
            raise ValueError(f"{path}: not JSON ({e})") from None
        return None
    if isinstance(obj, dict):
        return obj
    if strict:
        raise ValueError(f"{path}: not a JSON object")
    return None
