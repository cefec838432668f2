"""Run an exported decoder with numpy: a full forward, prefill then token-by-token with the KV
cache, greedy decoding, and held-out loss. The parity checks and the benchmark use these; the
serving stage has its own loop (it imports nothing from export/).

Both engines' graphs take `input_ids` [batch, seq], `attention_mask` [batch, past + seq] and one
`past_key_values.{i}.key/value` [batch, kv_heads, past, head_dim] per layer (empty at past = 0),
and return `logits` [batch, seq, vocab] and `present.{i}.key/value` [batch, kv_heads, past + seq,
head_dim]. optimum's graph also takes `position_ids`; the builder's derives positions from the
mask.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from doel.contracts.quant import KV_DTYPES


class OnnxLM:
    """One ONNX Runtime session over a bundle's decoder graph."""

    def __init__(self, path: str | Path, kv_heads: int, head_dim: int, threads: int = 0):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads  # 0: one per core
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Errors only: ONNX Runtime warns at every load that an overridable input (the graph's
        # logits_to_keep) is not folded as a constant, which is its point.
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.past_names = [n for n in self.input_names if n.startswith("past_key_values.")]
        # fp32, or fp16 / int8 where the export made the cache so (--kv-cache)
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.kv_dtype = np.dtype(KV_DTYPES[types[self.past_names[0]]]).type
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return {n: np.zeros(shape, self.kv_dtype) for n in self.past_names}

    def step(
        self, ids: np.ndarray, past: dict[str, np.ndarray], past_len: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Logits [batch, seq, vocab] for `ids` after `past_len` cached tokens, and the cache
        that now holds them (named as the next call's inputs)."""
        batch, seq = ids.shape
        feeds = {
            "input_ids": ids.astype(np.int64),
            "attention_mask": np.ones((batch, past_len + seq), np.int64),
            **past,
        }
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.broadcast_to(
                np.arange(past_len, past_len + seq, dtype=np.int64), (batch, seq)
            ).copy()
        outs = dict(zip(self.output_names, self.session.run(None, feeds)))
        present = {
            n.replace("present.", "past_key_values.", 1): v
            for n, v in outs.items()
            if n.startswith("present.")
        }
        return outs["logits"], present

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """One full forward from an empty cache."""
        return self.step(ids, self.empty_past(ids.shape[0]), 0)[0]

    def logits_with_cache(self, ids: np.ndarray, prefill: int) -> np.ndarray:
        """Prefill `prefill` tokens, then feed the rest one at a time through the KV cache; the
        logits of every position, as a full forward would give them."""
        out, past = self.step(ids[:, :prefill], self.empty_past(ids.shape[0]), 0)
        parts = [out]
        for t in range(prefill, ids.shape[1]):
            out, past = self.step(ids[:, t : t + 1], past, t)
            parts.append(out)
        return np.concatenate(parts, axis=1)

    def greedy(self, ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """Greedy continuation of one prompt: (new ids, prefill seconds, decode tokens/s)."""
        t0 = time.perf_counter()
        out, past = self.step(np.array([ids]), self.empty_past(1), 0)
        t1 = time.perf_counter()
        made = [int(out[0, -1].argmax())]
        for _ in range(new_tokens - 1):
            out, past = self.step(np.array([[made[-1]]]), past, len(ids) + len(made) - 1)
            made.append(int(out[0, -1].argmax()))
        t2 = time.perf_counter()
        return made, t1 - t0, (new_tokens - 1) / max(t2 - t1, 1e-9)

    def greedy_shared(self, ids: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """`greedy` for the builder's graphs, with one preallocated KV buffer per layer bound as
        both past and present: GroupQueryAttention writes the new entries in place, where the
        plain loop copies the whole cache every step (the manifest's past_present_share_buffer).
        """
        import onnxruntime as ort

        shape = (1, self.kv_heads, len(ids) + new_tokens, self.head_dim)
        kv = {
            n: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.kv_dtype))
            for n in self.past_names
        }
        binding = self.session.io_binding()
        for name, buf in kv.items():
            binding.bind_ortvalue_input(name, buf)

        def run(tokens: list[int], total: int) -> int:
            binding.bind_cpu_input("input_ids", np.array([tokens], np.int64))
            binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            # Outputs come back in bind order, and logits change shape after the prefill, so
            # they are rebound first on every step.
            binding.clear_binding_outputs()
            binding.bind_output("logits")
            for name, buf in kv.items():
                binding.bind_ortvalue_output(name.replace("past_key_values.", "present.", 1), buf)
            self.session.run_with_iobinding(binding)
            return int(binding.get_outputs()[0].numpy()[0, -1].argmax())

        t0 = time.perf_counter()
        made = [run(ids, len(ids))]
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            made.append(run([made[-1]], len(ids) + len(made)))
        t2 = time.perf_counter()
        return made, t1 - t0, (new_tokens - 1) / max(t2 - t1, 1e-9)


def windows(ids: list[int], size: int) -> list[list[int]]:
    """Windows of at most size + 1 tokens overlapping by one: every token after the first is a
    target exactly once (the convention of `train/evals/heldout.py`, so the figures compare)."""
    return [ids[s : s + size + 1] for s in range(0, len(ids) - 1, size)]


def nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed next-token cross entropy in nats; logits [T, V], targets [T]."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(z).sum(axis=-1))
    return float((logz - z[np.arange(len(targets)), targets]).sum())


def score(logits_fn, docs: list[list[int]], window: int) -> float:
    """Summed nats over the documents' targets, one window per forward (batch 1: no padding)."""
    total = 0.0
    for doc in docs:
        for w in windows(doc, window):
            total += nll_sum(logits_fn(np.array([w[:-1]]))[0], np.array(w[1:]))
    return total


def bits(nats: float) -> float:
    return nats / math.log(2)
