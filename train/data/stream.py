"""prepare's input side: the mixed documents in batches, NFC, exact duplicates dropped, each
with its split; and what a resume needs to continue the stream exactly (train/data/resume.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from hashlib import blake2b as _blake2b
from unicodedata import normalize as _nfc

from doel.train.data.tokenizer import mix_documents

DIGEST = 16  # bytes of a document's blake2b hash


def split_of(doc_hash: bytes, val_fraction: float) -> str:
    # The document's own hash decides its split: stable across runs, orders and machines.
    return "val" if int.from_bytes(doc_hash[:8], "little") < val_fraction * 2**64 else "train"


@dataclass
class Batch:
    texts: list[str] = field(default_factory=list)
    source: list[int] = field(default_factory=list)  # index into the stats
    is_val: list[bool] = field(default_factory=list)
    # The reader's state once this batch was read, and the digests it added (Reader.state):
    # what a resume record needs after this batch is written, though the reader is ahead.
    reader_state: tuple[dict, bytes] | None = None


class Reader:
    """Documents in batches, NFC, exact duplicates dropped, each with its split."""

    def __init__(self, sources, val_sources, mix, cfg, names: list[str]):
        self.sources, self.val_sources, self.mix, self.cfg = sources, val_sources, mix, cfg
        self.index = {n: i for i, n in enumerate(names)}
        self.val_names = {s.name for s in val_sources}
        self.seen: set[bytes] = set()
        self.val_hashes: set[bytes] = set()
        self.dup_with_val = 0
        self.duplicates = dict.fromkeys(names, 0)
        self.positions: list[dict] = [{}, {}]  # per group: source -> [documents read, chars]
        self.bytes_read = 0  # for the progress bar
        self._new: list[bytes] = []  # digests added since the last resume record
        self._val, self._text = False, ""

    def keep(self, name: str, text: str) -> bool:
        # Python's NFC: the tokenizers library's tables predate Unicode 10 (they leave U+09FE,
        # the Bengali sandhi mark, out of canonical order). Dedup sees the normalized text too.
        text = _nfc("NFC", text)
        raw = text.encode("utf-8")
        self.bytes_read += len(raw) + 1
        h = _blake2b(raw, digest_size=DIGEST).digest()
        if h in self.seen:
            self.duplicates[name] += 1
            if name not in self.val_names and h in self.val_hashes:
                self.dup_with_val += 1
            return False
        self.seen.add(h)
        self._new.append(h)
        if name in self.val_names:
            self.val_hashes.add(h)
            self._val = True
        else:
            self._val = self.cfg.val_fraction > 0 and split_of(h, self.cfg.val_fraction) == "val"
        self._text = text
        return True

    def batches(self) -> Iterator[Batch]:
        batch, chars = Batch(), 0
        # Explicit validation files go first, so that a training copy of one of their
        # documents counts as overlap, not as a harmless duplicate.
        groups = ((self.val_sources, None), (self.sources, self.mix))
        for (group, weights), pos in zip(groups, self.positions):
            docs = mix_documents(group, weights, self.cfg.text_field, keep=self.keep, position=pos)
            for name, _ in docs:
                text = self._text  # from keep()
                batch.texts.append(text)
                batch.source.append(self.index[name])
                batch.is_val.append(self._val)
                chars += len(text)
                if chars >= self.cfg.batch_chars:
                    batch.reader_state = self.state()
                    yield batch
                    batch, chars = Batch(), 0
        if batch.texts:
            batch.reader_state = self.state()
            yield batch

    def state(self) -> tuple[dict, bytes]:
        """Between batches: the positions and counts (JSON), and the digests added since the
        last call (raw bytes, appended to the record's side file)."""
        state = {
            "positions": copy.deepcopy(self.positions),  # the reader goes on changing them
            "duplicates": dict(self.duplicates),
            "dup_with_val": self.dup_with_val,
            "val_hashes": len(self.val_hashes),
            "bytes_read": self.bytes_read,
        }
        new, self._new = b"".join(self._new), []
        return state, new

    def restore(self, state: dict, digests: bytes) -> None:
        self.positions = state["positions"]
        self.duplicates = state["duplicates"]
        self.dup_with_val, self.bytes_read = state["dup_with_val"], state["bytes_read"]
        hashes = [digests[i : i + DIGEST] for i in range(0, len(digests), DIGEST)]
        self.seen = set(hashes)
        # The validation files are read first, so their digests are the first ones added.
        self.val_hashes = set(hashes[: state["val_hashes"]])
