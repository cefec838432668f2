"""Token shard format: a 64-byte self-describing header, then the tokens.

    offset  type     field
    0       8 bytes  magic b"DOELTOKS"
    8       uint32   format version (2; 1 is still read)
    12      uint32   bytes per token (2: uint16, 4: uint32)
    16      uint64   token count
    24      uint64   document count (each document starts with <|bos|>)
    32      uint32   vocabulary size
    36      uint32   id of <|bos|>
    40      uint32   id of <|eos|>, which ends every document (version 2; version 1: zero)
    44      20 bytes zero

All little-endian. A document is `<|bos|> text <|eos|>` (version 1: `<|bos|> text`), and a
shard never splits one, so each shard starts with <|bos|> (and, from version 2, ends with
<|eos|>). The <|eos|> is what a base model learns to say when its text is over: it is the
token every runtime of an exported model already stops at (generation_config.json's
eos_token_id, the GGUF's eos, genai_config.json, the Modelfile's stop, doel-serve), whereas a
predicted <|bos|> is a token none of them treats as an end. Version 1 shards still load; the
header's version (and meta.json's `format`) tells them apart.

Shards are written to a temporary name and renamed when complete; an interrupted prepare
continues the unfinished one from its recorded length (`ShardWriter.restore`). meta.json records
each shard's sha256, which a reader checks before training on it (`verify_shards`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doel.contracts.checksums import hash_files
from doel.train.common import Damaged, DoelError, sha256_file

MAGIC = b"DOELTOKS"
VERSION = 2
READS = (1, 2)  # versions this doel reads
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQIII")


@dataclass(frozen=True)
class ShardHeader:
    itemsize: int
    n_tokens: int
    n_docs: int
    vocab_size: int
    bos_id: int
    eos_id: int | None = None  # the id that ends every document; None: a version 1 shard

    @property
    def version(self) -> int:
        return 1 if self.eos_id is None else VERSION

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.itemsize == 2 else np.uint32)

    def pack(self) -> bytes:
        head = (MAGIC, self.version, self.itemsize, self.n_tokens, self.n_docs, self.vocab_size)
        eos = 0 if self.eos_id is None else self.eos_id  # version 1: those bytes are zero
        return _HEADER.pack(*head, self.bos_id, eos).ljust(HEADER_BYTES, b"\0")


def itemsize_for(vocab_size: int) -> int:
    """uint16 while every id fits, else uint32."""
    return 2 if vocab_size <= 1 << 16 else 4


def read_header(path: str | Path) -> ShardHeader:
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        raise DoelError(f"{path}: not a doel token shard (bad magic); re-run `doel-train prepare`")
    magic, version, itemsize, n_tokens, n_docs, vocab, bos, eos = _HEADER.unpack(
        raw[: _HEADER.size]
    )
    if version not in READS:
        raise DoelError(f"{path}: shard format version {version}, this doel reads {READS}")
    if itemsize not in (2, 4):
        raise DoelError(f"{path}: corrupt header (bytes per token {itemsize})")
    expected = HEADER_BYTES + n_tokens * itemsize
    if path.stat().st_size != expected:
        raise DoelError(
            f"{path}: truncated or corrupt: the header says {n_tokens} tokens ({expected} bytes) "
            f"but the file has {path.stat().st_size} bytes; re-run `doel-train prepare`"
        )
    return ShardHeader(itemsize, n_tokens, n_docs, vocab, bos, eos if version >= 2 else None)


def open_shard(path: str | Path) -> tuple[ShardHeader, np.ndarray]:
    """Memory-map a shard's tokens (read-only)."""
    h = read_header(path)
    tokens = np.memmap(path, dtype=h.dtype, mode="r", offset=HEADER_BYTES, shape=(h.n_tokens,))
    return h, tokens


# (path, size, mtime, ctime, inode, sha256) of the shards this process has checked: the loaders
# made again for validation and for the checks before step 1 do not hash them again. A write,
# a copy or a rename changes a file's ctime, which no program can set back.
_VERIFIED: set[tuple] = set()


def _seen(path: Path, sha256: str) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, sha256)


def verify_shards(paths: list[Path], digests: list[str]) -> None:
    """Check each shard against the sha256 meta.json records for it (several at a time, each
    once a process while unchanged); raise Damaged naming the first that differs."""
    todo = [(p, d, _seen(p, d)) for p, d in zip(paths, digests)]
    todo = [t for t in todo if t[2] not in _VERIFIED]
    for (path, want, key), got in zip(todo, hash_files([p for p, _, _ in todo])):
        if got != want:
            raise Damaged(
                f"{path} does not match the sha256 meta.json records for it: damaged since "
                "`doel-train prepare` wrote it; prepare it again, or pass --no-checksums to train "
                "on it as it is"
            )
        _VERIFIED.add(key)


class ShardWriter:
    """Append whole documents; a new shard starts when the next one would not fit. `eos_id`: the
    id that ends each document (written in the header, version 2); None writes version 1."""

    def __init__(
        self,
        out_dir: Path,
        split: str,
        vocab_size: int,
        bos_id: int,
        shard_tokens: int,
        eos_id: int | None = None,
    ):
        self.out_dir, self.split = Path(out_dir), split
        self.vocab_size, self.bos_id, self.shard_tokens = vocab_size, bos_id, shard_tokens
        self.eos_id = eos_id
        self.itemsize = itemsize_for(vocab_size)
        self.dtype = np.uint16 if self.itemsize == 2 else np.uint32
        self.shards: list[dict] = []
        self._file = None
        self._tokens = self._docs = 0

    def _open(self):
        self._path = self.out_dir / f"{self.split}_{len(self.shards):06d}.bin"
        self._tmp = self._path.with_name(self._path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(b"\0" * HEADER_BYTES)  # filled in on close, when the counts are known
        self._tokens = self._docs = 0

    def add(self, ids: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Add whole documents: `ids` is their concatenation, `doc_lengths` their sizes."""
        ends = np.cumsum(doc_lengths)
        start_doc, start_tok = 0, 0
        while start_doc < len(doc_lengths):
            if self._file is None:
                self._open()
            room = self.shard_tokens - self._tokens
            # Documents that fit whole in this shard (at least one if the shard is empty).
            fit = int(np.searchsorted(ends[start_doc:] - start_tok, room, side="right"))
            if fit == 0 and self._tokens == 0:
                fit = 1
            if fit == 0:
                self._close()
                continue
            stop_tok = int(ends[start_doc + fit - 1])
            chunk = ids[start_tok:stop_tok]
            self._file.write(np.ascontiguousarray(chunk, dtype=self.dtype).tobytes())
            self._tokens += len(chunk)
            self._docs += fit
            start_doc, start_tok = start_doc + fit, stop_tok
            if self._tokens >= self.shard_tokens:
                self._close()

    def _close(self):
        h = ShardHeader(
            self.itemsize, self._tokens, self._docs, self.vocab_size, self.bos_id, self.eos_id
        )
        self._file.seek(0)
        self._file.write(h.pack())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp, self._path)
        self.shards.append(
            {
                "file": self._path.name,
                "tokens": self._tokens,
                "documents": self._docs,
                "sha256": sha256_file(self._path),
            }
        )

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close()
        return self.shards

    def release(self) -> None:
        """Close the unfinished shard's file as it is (an interrupted run; see `restore`)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def state(self) -> dict:
        """The finished shards and the open one's counts, with its bytes on disk (fsync):
        what `restore` needs to continue byte for byte."""
        if self._file is None:
            return {"shards": list(self.shards), "open": None}
        self._file.flush()
        os.fsync(self._file.fileno())
        size = HEADER_BYTES + self._tokens * self.itemsize
        return {
            "shards": list(self.shards),
            "open": {"tokens": self._tokens, "docs": self._docs, "bytes": size},
        }

    def restore(self, state: dict) -> None:
        """Continue from `state`: the open shard is cut back to its recorded length (it may
        have been finished and renamed since), and later shards of this split are deleted."""
        self.shards = [dict(s) for s in state["shards"]]
        n, o = len(self.shards), state["open"]
        keep = self.out_dir / f"{self.split}_{n:06d}.bin.tmp" if o else None
        if o and not keep.exists() and keep.with_suffix("").exists():
            os.replace(keep.with_suffix(""), keep)  # finished after the record: reopen it
        remove_shards(self.out_dir, self.split, n, keep)
        if not o:
            return
        size = HEADER_BYTES + o["tokens"] * self.itemsize
        if not keep.exists() or keep.stat().st_size < size:
            raise DoelError(
                f"{keep} is missing or shorter than its resume record says; start over with "
                "`doel-train prepare --fresh`"
            )
        self._path, self._tmp = keep.with_suffix(""), keep
        self._file = open(keep, "r+b")
        self._file.truncate(size)
        self._file.seek(size)
        self._tokens, self._docs = o["tokens"], o["docs"]


def remove_shards(out_dir: Path, split: str, start: int = 0, keep: Path | None = None) -> None:
    """Delete the split's shards numbered `start` and up, finished or not (except `keep`)."""
    for p in Path(out_dir).glob(f"{split}_*.bin*"):
        stem = p.name.removesuffix(".tmp").removesuffix(".bin")
        index = stem[len(split) + 1 :]
        if p != keep and index.isdigit() and len(index) == 6 and int(index) >= start:
            p.unlink()
