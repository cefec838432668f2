"""Corpus -> packed token shards + meta.json, with the language balance shown honestly.

Mixture weights are shares of characters (what a reader of the corpus sees); the console and
meta.json show the resulting shares of characters and of tokens side by side, because a
tokenizer that is unfair to one language silently shifts the token balance. Exact duplicate
documents are dropped, and validation text found in the training set (hashed word n-grams,
or whole documents) fails the run. An interrupted run continues where it stopped, to the same
bytes (train/data/resume.py).

Each document is written as `<|bos|> text <|eos|>` (train/data/shards.py, format version 2): a
model trained on the shards ends its text by predicting <|eos|>, the token every runtime of an
exported model stops at. meta.json's `format` says so (`document`, `version`) and its
`tokenizer` gives `eos_id`; the per-source `tokens` count the text's tokens only (neither
marker), the splits' `tokens` every token in the shards.
"""

from __future__ import annotations

import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import normalizers
from tqdm import tqdm

from doel.contracts.lock import FolderLock
from doel.train.common import DoelError, atomic_write_json, sha256_file
from doel.train.config import resolved
from doel.train.data.overlap import OverlapCheck
from doel.train.data.resume import ResumeRecord, fingerprint
from doel.train.data.shards import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    ShardWriter,
    itemsize_for,
    remove_shards,
)
from doel.train.data.stream import Batch, Reader
from doel.train.data.textio import Source, resolve_sources
from doel.train.data.tokenizer import BOS, EOS, load_tokenizer, tokenizer_file

SPLITS = ("train", "val")
DOCUMENT = f"{BOS} text {EOS}"  # how each document lies in the shards (meta.json's format)


@dataclass(frozen=True)
class PrepareConfig:
    val_fraction: float = 0.0  # share of documents held out (by a hash of their text)
    shard_tokens: int = 100_000_000
    text_field: str = "text"
    ngram: int = 20  # tokens per n-gram in the overlap check (about 80 characters)
    overlap_sample: int = 1  # keep 1 in N n-gram hashes (8 bytes each; raise on huge corpora)
    max_val_overlap: float = 0.0  # largest tolerated share of validation n-grams seen in train
    batch_chars: int = 4_000_000  # characters encoded per batch

    def __post_init__(self):
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        for name in ("shard_tokens", "ngram", "overlap_sample", "batch_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.max_val_overlap <= 1.0:
            raise ValueError(f"max_val_overlap must be in [0, 1], got {self.max_val_overlap}")


def parse_weights(items: list[str], sources: list[Source]) -> dict[str, float] | None:
    """`SOURCE=SHARE` items -> shares of characters summing to 1, one for every source."""
    if not items:
        return None
    names = [s.name for s in sources]
    raw: dict[str, float] = {}
    for item in items:
        name, sep, share = item.rpartition("=")
        if not sep or name not in names:
            raise DoelError(f"--weights {item!r}: expected SOURCE=SHARE with SOURCE one of {names}")
        try:
            raw[name] = float(share)
        except ValueError:
            raise DoelError(f"--weights {item!r}: share {share!r} is not a number") from None
        if raw[name] < 0:
            raise DoelError(f"--weights {item!r}: a share cannot be negative")
    missing = [n for n in names if n not in raw]
    if missing:
        raise DoelError(f"--weights gives no share for {missing}; give every source one")
    total = sum(raw.values())
    if total <= 0:
        raise DoelError("--weights: the shares add up to zero")
    return {n: v / total for n, v in raw.items()}


def prepare(
    tokenizer_path: str | Path,
    data: list[str],
    out_dir: str | Path,
    cfg: PrepareConfig = PrepareConfig(),
    weights: list[str] = (),
    val: list[str] = (),
    progress: bool = True,
    log=print,
    resume: bool = True,
    record_every: float = 300.0,
) -> dict:
    """Tokenize the corpus into out_dir/{train,val}_NNNNNN.bin and write meta.json.

    Resumable: a resume record is saved at every finished shard and every `record_every`
    seconds, and a run in the same out_dir with the same inputs and settings continues from
    it, to the same bytes (`resume=False`: start over). meta.json marks a finished folder.
    The folder is locked meanwhile: a second prepare into it stops, naming this one."""
    with FolderLock(out_dir, "doel-train prepare", DoelError):
        return _prepare(
            tokenizer_path, data, out_dir, cfg, weights, val, progress, log, resume, record_every
        )


def _prepare(
    tokenizer_path, data, out_dir, cfg, weights, val, progress, log, resume, record_every
) -> dict:
    if val and cfg.val_fraction:
        raise DoelError("give either --val PATH... or --val-fraction, not both")
    tok, tok_file, (bos, eos), vocab = _load(tokenizer_path)
    sources, val_sources = resolve_sources(list(data)), resolve_sources(list(val))
    mix = parse_weights(list(weights), sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # meta.json marks a finished folder
    tok_sha = sha256_file(tok_file)
    # A record written for shards of another format (documents without <|eos|>) starts over.
    fp = fingerprint(tok_sha, sources, val_sources, mix, cfg) | {"shard_format": VERSION}
    record = ResumeRecord(out, fp)
    if not resume:
        record.clear()
    saved = record.load(log) if resume else None
    run = _Run(out, vocab, (bos, eos), cfg, sources, val_sources, mix, saved, log)
    paths = [p for s in sources + val_sources for p in s.paths if not p.startswith("hf:")]
    total = sum(Path(p).stat().st_size for p in paths)
    bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="prepare",
               disable=not progress, smoothing=0.1, initial=run.reader.bytes_read)  # fmt: skip
    _drop_nfc(tok)  # this tokenizer only encodes documents that are NFC already
    t0, last = time.time(), time.time()
    try:
        for batch, encs in _encoded(tok, run.reader.batches()):
            closed = run.write(batch, encs)
            bar.update(batch.reader_state[0]["bytes_read"] - bar.n)
            if closed or time.time() - last >= record_every:  # rare: the speed is kept
                record.save(*run.state(time.time() - t0))
                last = time.time()
        # Every document is in: a rerun after a failed overlap check only checks again.
        record.save(*run.state(time.time() - t0))
        meta = run.finish(tok_file, tok_sha, time.time() - t0, data, log)
    finally:  # interrupted: the unfinished shards stay on disk for the resume
        bar.close()
        record.close()
        for w in run.writers.values():
            w.release()
    atomic_write_json(out / "meta.json", meta)
    record.clear()
    log(format_balance(meta))
    return meta


def _encoded(tok, batches):
    """(batch, encodings) in order. The tokenizer encodes a batch on every core without the
    GIL and without offsets (`_fast`), which shards do not need, in a worker thread, while this
    thread writes the batch before it (turning encodings into ids holds the GIL for about as
    long as the encoding takes) and reads the next."""
    with ThreadPoolExecutor(1) as pool:
        ahead = None
        for batch in batches:
            job = pool.submit(tok.encode_batch_fast, batch.texts, add_special_tokens=True)
            if ahead is not None:
                yield ahead[0], ahead[1].result()
            ahead = (batch, job)
        if ahead is not None:
            yield ahead[0], ahead[1].result()


def _load(tokenizer_path):
    tok = load_tokenizer(tokenizer_path)
    tok_file = tokenizer_file(tokenizer_path)
    marks = []
    for name in (BOS, EOS):
        marks.append(tok.token_to_id(name))
        if marks[-1] is None:
            raise DoelError(f"{tok_file} has no {name} token; train it with `doel-train tokenizer`")
    return tok, tok_file, tuple(marks), tok.get_vocab_size(with_added_tokens=True)


def _drop_nfc(tok) -> None:
    """Drop the tokenizer's normalizer when it is NFC alone: documents reach it NFC already.

    Python's NFC (newer Unicode) has run on every document, and NFC is stable across Unicode
    versions, so the library's older NFC would return each text unchanged (tests check this,
    Bengali marks the old tables do not know included): the tokens stay the same, and the
    encoding takes about a tenth less time. Any other normalizer stays.
    """

    if type(tok.normalizer) is normalizers.NFC:
        tok.normalizer = None


class _Run:
    """The reader, the shard writers, the statistics and the overlap check of one run, and
    their state for the resume record."""

    def __init__(self, out, vocab, marks, cfg, sources, val_sources, mix, saved, log):
        (bos, self.eos), self.cfg, self.mix = marks, cfg, mix
        self.writers = {
            s: ShardWriter(out, s, vocab, bos, cfg.shard_tokens, self.eos) for s in SPLITS
        }
        self.stats = {s.name: _new_stats(s) for s in sources + val_sources}
        self.overlap = OverlapCheck(cfg.ngram, cfg.overlap_sample)
        self.check = bool(val_sources) or cfg.val_fraction > 0  # no validation split, no check
        self.reader = Reader(sources, val_sources, mix, cfg, list(self.stats))
        self.typecode = "H" if itemsize_for(vocab) == 2 else "I"
        self.seconds = 0.0  # of earlier attempts
        self._reader_state, self._seen = self.reader.state()[0], []  # as of the last write
        if saved is None:
            for split in SPLITS:  # a fresh start leaves no shard of an older run behind
                remove_shards(out, split)
            return
        state, side = saved
        for split, w in self.writers.items():
            w.restore(state["writers"][split])
        self.stats, self.seconds = state["stats"], state["seconds"]
        self.reader.restore(state["reader"], side["seen"])
        self._reader_state = self.reader.state()[0]
        self.overlap.restore(side)
        n = sum(p[0] for pos in self.reader.positions for p in pos.values())
        done = sum(len(w.shards) for w in self.writers.values())
        log(f"prepare: resuming after {n:,} documents read and {done} finished shard(s)")

    def write(self, batch: Batch, encs: list) -> bool:
        """Write a batch to the shards; True when a shard was finished."""
        before = sum(len(w.shards) for w in self.writers.values())
        # Each document: its ids (<|bos|> first, from the tokenizer), then <|eos|>.
        lengths = np.fromiter(map(len, encs), dtype=np.int64, count=len(encs)) + 1
        chars = np.fromiter(map(len, batch.texts), dtype=np.int64, count=len(encs))
        source = np.array(batch.source, dtype=np.int64)
        is_val = np.array(batch.is_val, dtype=bool)
        for split, mask in (("train", ~is_val), ("val", is_val)):
            if not mask.any():
                continue
            ids, eos = array(self.typecode), self.eos  # one flat buffer: no per-document arrays
            for e, m in zip(encs, mask.tolist()):
                if m:
                    ids.extend(e.ids)
                    ids.append(eos)
            ids, n = np.frombuffer(ids, dtype=f"u{ids.itemsize}"), lengths[mask]
            self.writers[split].add(ids, n)
            if self.check:
                val = zip(batch.texts, batch.is_val)
                texts = [t for t, v in val if v] if split == "val" else []
                self.overlap.add(split, ids, n, texts)
            self._count(split, source[mask], chars[mask], n)
        self._reader_state, digests = batch.reader_state
        self._seen.append(digests)
        return sum(len(w.shards) for w in self.writers.values()) > before

    def _count(self, split: str, src, chars, n) -> None:
        k = len(self.stats)
        for key, counts in (
            ("documents", np.bincount(src, minlength=k)),
            ("characters", np.bincount(src, weights=chars, minlength=k)),
            ("tokens", np.bincount(src, weights=n - 2, minlength=k)),  # not <|bos|>, <|eos|>
        ):
            for st, c in zip(self.stats.values(), counts.tolist()):
                st[f"{split}_{key}"] += int(c)

    def state(self, seconds: float) -> tuple[dict, dict[str, bytes]]:
        reader, seen = self._reader_state, b"".join(self._seen)
        self._seen = []
        state = {
            "writers": {s: w.state() for s, w in self.writers.items()},
            "stats": self.stats,
            "reader": reader,
            "seconds": self.seconds + seconds,
        }
        return state, {"seen": seen} | self.overlap.take_new()

    def finish(self, tok_file, tok_sha, seconds, data, log) -> dict:
        stats, reader = self.stats, self.reader
        for name, n in reader.duplicates.items():
            stats[name]["duplicates_dropped"] += n
        shards = {s: w.close() for s, w in self.writers.items()}
        n_chars = sum(st["train_characters"] + st["val_characters"] for st in stats.values())
        if not n_chars:
            raise DoelError(f"no text found in {data}: the corpus is empty")
        w = self.writers["train"]
        total = self.seconds + seconds
        marks = (w.bos_id, w.eos_id)
        meta = _meta(
            tok_file, tok_sha, w.vocab_size, marks, self.cfg, self.mix, stats, shards, total
        )
        meta["overlap"] = self.overlap.result()
        meta["overlap"]["exact_duplicates_of_validation_in_train"] = reader.dup_with_val
        _check_overlap(meta["overlap"], self.cfg, log)
        return meta


def _new_stats(src: Source) -> dict:
    keys = ("documents", "characters", "tokens")
    return {"paths": list(src.paths), "duplicates_dropped": 0} | {
        f"{split}_{k}": 0 for split in ("train", "val") for k in keys
    }


def _meta(tok_file, tok_sha, vocab, marks, cfg, mix, stats, shards, seconds) -> dict:
    tot_c = sum(s["train_characters"] + s["val_characters"] for s in stats.values())
    tot_t = sum(s["train_tokens"] + s["val_tokens"] for s in stats.values())
    for name, s in stats.items():
        c, t = s["train_characters"] + s["val_characters"], s["train_tokens"] + s["val_tokens"]
        s.update(documents=s["train_documents"] + s["val_documents"], characters=c, tokens=t)
        s["requested_char_share"] = mix.get(name) if mix else None
        s["char_share"] = c / tot_c if tot_c else 0.0
        s["token_share"] = t / tot_t if tot_t else 0.0
        s["chars_per_token"] = c / t if t else 0.0
    itemsize = itemsize_for(vocab)
    return {
        "format": {
            "magic": MAGIC.decode(),
            "version": VERSION,
            "header_bytes": HEADER_BYTES,
            "dtype": "uint16" if itemsize == 2 else "uint32",
            "byteorder": "little",
            "document": DOCUMENT,
        },
        "tokenizer": {
            "path": str(tok_file),
            "sha256": tok_sha,
            "vocab_size": vocab,
            "bos_id": marks[0],
            "eos_id": marks[1],
        },
        "splits": {
            split: {
                "tokens": sum(x["tokens"] for x in sh),
                "documents": sum(x["documents"] for x in sh),
                "shards": sh,
            }
            for split, sh in shards.items()
        },
        "sources": stats,
        "config": resolved(cfg),
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tot_t / seconds, 1) if seconds > 0 else None,
    }


def _check_overlap(ov: dict, cfg: PrepareConfig, log) -> None:
    bad = ov["exact_duplicates_of_validation_in_train"] > 0 or ov["share"] > cfg.max_val_overlap
    if not bad:
        return
    whole = ov["exact_duplicates_of_validation_in_train"]
    worst = "\n".join(f"  {w['share']:.0%} of: {w['text'][:100]!r}" for w in ov["worst"])
    raise DoelError(
        f"validation text also sits in the training set: {ov['share']:.2%} of validation "
        f"{ov['ngram_tokens']}-token n-grams appear in train, {whole} "
        f"validation documents appear there whole. Worst validation documents:\n{worst}\n"
        "Remove them from one side, or tolerate it with --set max_val_overlap=F."
    )


def format_balance(meta: dict) -> str:
    head = (
        f"{'source':<28}{'docs':>9}{'chars':>13}{'share':>8}{'asked':>8}{'tokens':>12}"
        f"{'share':>8}{'ch/tok':>8}{'dups':>7}"
    )
    lines = ["language balance (shares of characters and of tokens, side by side)", head]
    for name, s in meta["sources"].items():
        asked = f"{s['requested_char_share']:.1%}" if s["requested_char_share"] is not None else "-"
        lines.append(
            f"{name[:27]:<28}{s['documents']:>9,}{s['characters']:>13,}{s['char_share']:>8.1%}"
            f"{asked:>8}{s['tokens']:>12,}{s['token_share']:>8.1%}{s['chars_per_token']:>8.2f}"
            f"{s['duplicates_dropped']:>7,}"
        )
    sp = meta["splits"]
    lines.append(
        f"train {sp['train']['tokens']:,} tokens in {len(sp['train']['shards'])} shard(s), "
        f"val {sp['val']['tokens']:,}; {meta['tokens_per_second']:,.0f} tokens/s"
    )
    return "\n".join(lines)
