"""Train/validation overlap by hashed n-grams of token ids.

Every window of n tokens inside one document gets a 64-bit hash (position-weighted sum of the
ids, vectorised over a whole batch); with `sample` N only hashes divisible by N are kept, which
bounds memory on large corpora and still finds any shared passage a few times N tokens long.
Documents shorter than n tokens are left to the exact-duplicate check.
"""

from __future__ import annotations

import json

import numpy as np

# Fixed odd multipliers, one per position in the window (deterministic across runs).
_MULT = np.random.default_rng(0x0D0E1).integers(1, 2**63, size=256, dtype=np.uint64) | np.uint64(1)


def window_hashes(ids: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the n-token windows of concatenated documents, and each window's document."""
    m = len(ids) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    ids = ids.astype(np.uint64)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h += ids[k : k + m] * _MULT[k % len(_MULT)]
    ends = np.cumsum(lengths)
    doc = np.repeat(np.arange(len(lengths)), lengths)[:m]
    inside = np.arange(m) + n <= ends[doc]  # the window does not run into the next document
    return h[inside], doc[inside]


class OverlapCheck:
    def __init__(self, n: int = 20, sample: int = 1):
        self.n, self.sample = n, np.uint64(sample)
        self._train: list[np.ndarray] = []
        self._val: list[np.ndarray] = []
        self._val_doc: list[np.ndarray] = []
        self._val_text: list[str] = []
        self._saved = (0, 0, 0)  # entries of _train, _val, _val_text given to `take_new`

    def add(self, split: str, ids: np.ndarray, lengths: np.ndarray, texts: list[str]) -> None:
        h, doc = window_hashes(ids, lengths, self.n)
        if self.sample != 1:
            keep = h % self.sample == 0
            h, doc = h[keep], doc[keep]
        if split == "train":
            self._train.append(h)
        else:
            self._val.append(h)
            self._val_doc.append(doc + len(self._val_text))
            self._val_text.extend(t[:200] for t in texts)

    def take_new(self) -> dict[str, bytes]:
        """What was added since the last call, as raw bytes for prepare's resume record (the
        side files only grow: `restore` gets their whole contents back)."""

        t, v, x = self._saved
        self._saved = (len(self._train), len(self._val), len(self._val_text))
        return {
            "train_ngrams": b"".join(a.tobytes() for a in self._train[t:]),
            "val_ngrams": b"".join(a.tobytes() for a in self._val[v:]),
            "val_docs": b"".join(a.astype(np.int64).tobytes() for a in self._val_doc[v:]),
            "val_texts": "".join(json.dumps(s) + "\n" for s in self._val_text[x:]).encode(),
        }

    def restore(self, side: dict[str, bytes]) -> None:

        # One array each: result() concatenates them anyway, and val_docs are absolute.
        self._train = [np.frombuffer(side["train_ngrams"], np.uint64)]
        self._val = [np.frombuffer(side["val_ngrams"], np.uint64)]
        self._val_doc = [np.frombuffer(side["val_docs"], np.int64)]
        self._val_text = [json.loads(s) for s in side["val_texts"].split(b"\n")[:-1]]
        self._saved = (1, 1, len(self._val_text))

    def result(self) -> dict:
        val = np.concatenate(self._val) if self._val else np.zeros(0, np.uint64)
        # Sorted and searched: numpy 2.4's np.unique/np.isin hash uint64s about 100x slower.
        train = np.sort(np.concatenate(self._train)) if self._train else val[:0]
        at = np.minimum(np.searchsorted(train, val), max(len(train) - 1, 0))
        hit = train[at] == val if len(train) else np.zeros(len(val), dtype=bool)
        per_doc = []
        if len(val):
            doc = np.concatenate(self._val_doc)
            hits = np.bincount(doc, weights=hit, minlength=len(self._val_text))
            total = np.bincount(doc, minlength=len(self._val_text))
            for i in np.flatnonzero(hits)[np.argsort(-(hits / np.maximum(total, 1))[hits > 0])]:
                per_doc.append({"share": float(hits[i] / total[i]), "text": self._val_text[i]})
        return {
            "ngram_tokens": self.n,
            "sample": int(self.sample),
            "val_ngrams": int(len(val)),
            "in_train": int(hit.sum()),
            "share": float(hit.mean()) if len(val) else 0.0,
            "val_documents_with_overlap": len(per_doc),
            "worst": per_doc[:3],
        }
