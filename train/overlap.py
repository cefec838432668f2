"""Train/validation overlap by hashed word n-grams.

Every n-gram of words gets a 64-bit hash (a stable CRC of each word, mixed by position); with
`sample` N only hashes divisible by N are kept, which scales to large corpora and still finds
any shared passage a few times N words long.
"""

from __future__ import annotations

import zlib

import numpy as np

# Fixed odd multipliers, one per position in the n-gram (deterministic across runs).
_MULT = np.random.default_rng(0x0D0E1).integers(1, 2**63, size=64, dtype=np.uint64) | np.uint64(1)


def ngram_hashes(text: str, n: int) -> np.ndarray:
    words = text.split()
    if not words:
        return np.zeros(0, dtype=np.uint64)
    wh = np.fromiter((zlib.crc32(w.encode("utf-8")) for w in words), dtype=np.uint64,
                     count=len(words))
    if len(wh) < n:  # a short document is one n-gram of all its words
        return np.array([int((wh * _MULT[: len(wh)]).sum())], dtype=np.uint64)
    m = len(wh) - n + 1
    out = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            out += wh[k : k + m] * _MULT[k % len(_MULT)]
    return out


class OverlapCheck:
    def __init__(self, n: int = 13, sample: int = 1):
        self.n, self.sample = n, np.uint64(sample)
        self.train: set[int] = set()
        self.val: list[tuple[str, np.ndarray]] = []

    def _sampled(self, text: str) -> np.ndarray:
        h = ngram_hashes(text, self.n)
        return h if self.sample == 1 else h[h % self.sample == 0]

    def add_train(self, text: str) -> None:
        self.train.update(self._sampled(text).tolist())

    def add_val(self, text: str) -> None:
        self.val.append((text[:200], self._sampled(text)))

    def result(self) -> dict:
        hits = total = 0
        per_doc = []
        for text, h in self.val:
            k = sum(1 for x in h.tolist() if x in self.train)
            hits, total = hits + k, total + len(h)
            if k:
                per_doc.append({"share": k / len(h), "text": text})
        per_doc.sort(key=lambda d: -d["share"])
        return {
            "ngram": self.n,
            "sample": int(self.sample),
            "val_ngrams": total,
            "in_train": hits,
            "share": hits / total if total else 0.0,
            "val_documents_with_overlap": len(per_doc),
            "worst": per_doc[:3],
        }
