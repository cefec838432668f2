"""prepare's resume record: an interrupted tokenization continues where it stopped.

OUT/prepare_state/ holds `record.json` (rewritten atomically) and side files that only grow
(the dedup digests, the overlap check's n-gram hashes); the record holds each side file's
length, so bytes appended after the last record are cut off on resume, as are shard bytes and
whole shards written after it. The record says how many documents were read from each source,
so a resume re-reads (parses) them without normalizing, hashing or encoding them and continues
with the next one: the output is byte for byte that of an uninterrupted run. The record also
holds what the output depends on (the fingerprint): other inputs or settings start over, and
the log says which part changed. Plain JSON and raw bytes only, no pickles.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from doel.train.common import atomic_write_json, sha256_file
from doel.train.config import resolved

FOLDER = "prepare_state"
FORMAT = 1


def fingerprint(tok_sha256: str, sources, val_sources, mix, cfg) -> dict:
    """Everything the shards depend on: the tokenizer's bytes, each input file's path, size
    and modification time (a `hf:` dataset by its name), the weights and the settings."""

    def files(srcs) -> list:
        return [[s.name, [_stat(p) for p in s.paths]] for s in srcs]

    return {
        "format": FORMAT,
        "tokenizer_sha256": tok_sha256,
        "data": files(sources),
        "val": files(val_sources),
        "weights": mix,
        # The tolerated overlap changes no shard: raising it after a failed check resumes.
        "config": {k: v for k, v in resolved(cfg).items() if k != "max_val_overlap"},
    }


def _stat(path: str) -> list:
    if path.startswith("hf:"):
        return [path]
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


class ResumeRecord:
    """Load, save and clear OUT/prepare_state/."""

    def __init__(self, out: Path, fp: dict):
        self.dir, self.fp = Path(out) / FOLDER, fp
        self._logs: dict = {}  # side file name -> open append handle

    def load(self, log) -> tuple[dict, dict[str, bytes]] | None:
        """The saved state and side files, or None (and the folder cleared) when there is no
        usable record: then the run starts over, and the log says why."""
        path = self.dir / "record.json"
        if not path.is_file():
            self.clear()
            return None
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            why = self._unusable(rec)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"its record is unreadable ({e!r})"
        if why:
            log(f"prepare: not resuming from {self.dir}: {why}; starting over")
            self.clear()
            return None
        side = {}
        for name, length in rec["side"].items():
            p = self.dir / f"{name}.bin"
            with open(p, "r+b") as f:  # cut off what was appended after the record
                f.truncate(length)
                side[name] = f.read()
        return rec["state"], side

    def _unusable(self, rec: dict) -> str | None:
        old, new = rec.get("fingerprint", {}), self.fp
        changed = [k for k in new if old.get(k) != new[k]]
        if changed:
            what = {"tokenizer_sha256": "the tokenizer", "data": "the data files"}
            what |= {"val": "the validation files", "weights": "the weights"}
            what |= {"config": "the settings", "format": "the record's format"}
            names = " and ".join(what.get(k, k) for k in changed)
            return f"{names} changed since it was written"
        for name, length in rec["side"].items():
            p = self.dir / f"{name}.bin"
            if not p.is_file() or p.stat().st_size < length:
                return f"{p} is missing or shorter than the record says"
        for split, w in rec["state"]["writers"].items():
            for s in w["shards"]:
                p = self.dir.parent / s["file"]
                if not p.is_file() or sha256_file(p) != s["sha256"]:
                    return f"the finished shard {p} is missing or was changed"
            p = self.dir.parent / f"{split}_{len(w['shards']):06d}.bin"
            sizes = [q.stat().st_size for q in (p, p.with_name(p.name + ".tmp")) if q.is_file()]
            if w["open"] and max(sizes, default=-1) < w["open"]["bytes"]:
                return f"the unfinished shard {p}.tmp is missing or shorter than recorded"
        return None

    def save(self, state: dict, side: dict[str, bytes]) -> None:
        """Append the side data, make it durable, then replace the record (the shards' bytes
        were made durable by the caller before): a crash at any point leaves a usable record."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lengths = {}
        for name, data in side.items():
            if name not in self._logs:
                self._logs[name] = open(self.dir / f"{name}.bin", "ab")
            f = self._logs[name]
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            lengths[name] = f.tell()
        record = {"fingerprint": self.fp, "state": state, "side": lengths}
        atomic_write_json(self.dir / "record.json", record)

    def clear(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        for f in self._logs.values():
            f.close()
        self._logs.clear()
