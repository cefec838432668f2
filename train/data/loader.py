"""Batches from token shards: memory-mapped, deterministic for a seed, resumable exactly.

The shards of a split form one stream in which every document starts with <|bos|> and ends
with <|eos|> (shard version 2; version 1 shards, without the <|eos|>, load the same). It is cut
into windows of seq_len + 1 tokens (inputs and the targets shifted by one); each epoch visits
all windows in an order drawn from (seed, epoch). The loader's position is (epoch, cursor), so
`state_dict()` / `load_state_dict()` restore it exactly.

Under data parallelism each of `world_size` ranks takes its slice of the same global batch, so
the ranks' batches never overlap, leave no gap, and together equal the single-process stream
with the same global batch. The position counts global rows, so it resumes at another world size
as long as the global batch (rows per rank × ranks) is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from doel.train.common import DoelError, sha256_file
from doel.train.data.shards import HEADER_BYTES, open_shard, verify_shards
from doel.train.data.tokenizer import tokenizer_file


def read_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DoelError(
            f"{data_dir} is not a finished shard folder (no meta.json); "
            "make one with `doel-train prepare --tokenizer ... --data ... --out DIR`"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def check_tokenizer(meta: dict, tokenizer_path: str | Path, data_dir) -> None:
    """Shards are only meaningful with the tokenizer that made them."""
    p = tokenizer_file(tokenizer_path)
    got = sha256_file(p)
    if got != meta["tokenizer"]["sha256"]:
        raise DoelError(
            f"the shards in {data_dir} were made with a different tokenizer "
            f"(sha256 {meta['tokenizer']['sha256'][:12]}…, made from {meta['tokenizer']['path']}) "
            f"than {p} (sha256 {got[:12]}…); pass that tokenizer or re-run `doel-train prepare`"
        )


class TokenLoader:
    def __init__(
        self,
        data_dir,
        split="train",
        batch_size=8,
        seq_len=512,
        seed=0,
        tokenizer=None,
        rank=0,
        world_size=1,
        verify=True,
    ):
        """`verify`: check the split's shards against meta.json's sha256 first (once a process
        while a file is unchanged: ~1 GB/s a core)."""
        self.data_dir, self.split = Path(data_dir), split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        meta = read_meta(data_dir)
        if tokenizer is not None:
            check_tokenizer(meta, tokenizer, data_dir)
        self.bos_id, self.verify = meta["tokenizer"]["bos_id"], verify
        self.vocab_size = meta["tokenizer"]["vocab_size"]
        records = meta["splits"][split]["shards"]
        self.paths = [self.data_dir / s["file"] for s in records]
        self.shards = [open_shard(p)[1] for p in self.paths]  # the header checks come first
        if verify:
            hashed = [(p, s["sha256"]) for p, s in zip(self.paths, records) if s.get("sha256")]
            verify_shards([p for p, _ in hashed], [d for _, d in hashed])
        # Window w of shard i covers tokens [w*T, w*T + T + 1).
        counts = np.array([max((len(s) - 1) // seq_len, 0) for s in self.shards], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(counts)])
        self.n_windows = int(self._offsets[-1])
        if self.n_windows < self.global_batch:
            raise DoelError(
                f"the {split} split of {data_dir} holds {self.n_windows} windows of "
                f"{seq_len + 1} tokens, fewer than one global batch of {self.global_batch}; "
                "lower batch_size or seq_len, or prepare more text"
            )
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def _locate(self, w: int) -> tuple[int, int]:
        """(shard, first token) of window w."""
        shard = int(np.searchsorted(self._offsets, w, side="right") - 1)
        return shard, (w - int(self._offsets[shard])) * self.seq_len

    def window(self, w: int) -> np.ndarray:
        shard, start = self._locate(w)
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64)

    def _check_ids(self, idx: np.ndarray, rows: np.ndarray) -> None:
        """Every id within the vocabulary: an id past it would index outside the embedding (a
        bare IndexError on a CPU, a device-side assert on a GPU). One max a batch; the first
        bad id is named by its shard and offset."""
        if rows.max(initial=0) < self.vocab_size:
            return
        r, c = (int(i) for i in np.argwhere(rows >= self.vocab_size)[0])
        shard, start = self._locate(int(idx[r]))
        at, path = start + c, self.paths[shard]
        byte = HEADER_BYTES + at * self.shards[shard].itemsize
        raise DoelError(
            f"{path}: token {at:,} (byte {byte:,}) is id {rows[r, c]}, outside the vocabulary "
            f"of {self.vocab_size} that meta.json gives: the shard is damaged or was made with "
            "another tokenizer; prepare it again"
        )

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (batch_size, seq_len) int64; targets are inputs shifted by 1."""
        if self.cursor + self.global_batch > self.n_windows:  # the remainder waits for no one
            self.epoch, self.cursor = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        start = self.cursor + self.rank * self.batch_size  # this rank's slice of the batch
        idx = self._perm[start : start + self.batch_size]
        self.cursor += self.global_batch
        rows = np.stack([self.window(int(w)) for w in idx])  # (B, T+1)
        self._check_ids(idx, rows)
        return rows[:, :-1], rows[:, 1:]

    def peek(self, n: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
        """The next n batches, leaving the loader where it was (the gradient gate, the compile
        warm-up and the verification suite look ahead without consuming)."""
        state = self.state_dict()
        try:
            return [self.next_batch() for _ in range(n)]
        finally:
            self.load_state_dict(state)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        state.setdefault("global_batch", state.get("batch_size"))  # written before ranks existed
        for key in ("split", "seed", "seq_len", "global_batch"):
            if state[key] != getattr(self, key):
                raise DoelError(
                    f"loader state was saved with {key}={state[key]!r}, this loader has "
                    f"{getattr(self, key)!r}; resume with the same data settings"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)
