"""Choosing the next token from logits: pure numpy functions, no state but the caller's generator.

Order (as in vLLM and Hugging Face): penalties on the raw logits, then temperature, top-k, top-p,
then one draw. Temperature 0 is greedy. The same seed gives the same tokens, because every draw
comes from the one `numpy.random.Generator` made from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Below this a temperature is greedy: dividing logits by it would overflow to inf (as vLLM).
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 0.01  # dividing by less overflows the same way
TOP_P_CANDIDATES = 256  # tokens sorted first for top-p (see top_p_probs)


@dataclass(frozen=True)
class SamplingParams:
    """What the engine needs to pick tokens; the HTTP layer builds it (`to_sampling_params`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off; over prompt and completion (CTRL-style)
    presence_penalty: float = 0.0  # OpenAI's: over the completion only
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        checks = {
            "max_tokens": self.max_tokens >= 0,  # 0: only score the prompt (echo)
            "temperature": self.temperature >= 0,
            "top_k": self.top_k >= 0,
            "top_p": 0 < self.top_p <= 1,
            "repetition_penalty": self.repetition_penalty >= MIN_REPETITION_PENALTY,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid sampling parameter(s): {', '.join(bad)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def apply_penalties(
    logits: np.ndarray, p: SamplingParams, context: np.ndarray, completion: np.ndarray
) -> np.ndarray:
    """Logits [vocab] with the penalties applied; `context` is prompt + completion ids so far."""
    out = logits.astype(np.float64, copy=True)
    if p.repetition_penalty != 1.0 and len(context):
        seen = np.unique(context)
        # Dividing a negative logit would raise it, so negatives are multiplied instead.
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and len(completion):
        counts = np.bincount(completion, minlength=len(out))[: len(out)]
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Logits with everything below the k-th largest set to -inf (ties at the k-th kept)."""
    if k <= 0 or k >= len(logits):
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, -np.inf)


def top_p_probs(probs: np.ndarray, p: float, candidates: int = TOP_P_CANDIDATES) -> np.ndarray:
    """The smallest set of most likely tokens whose mass reaches p, renormalised.

    Sorting the whole vocabulary for every token would cost more than a decode step of the 0.4B
    model (its step and this sampling's times: benchmarks/results/profile_serve_0.4b_cpu-*.md,
    "Sampling one row of logits"). The mass is
    nearly always in the few most likely tokens, so only those are sorted: the `candidates`
    largest (with every token tied with the smallest of them, so that ties keep the order of a
    full stable sort), widened 8-fold until they hold p. The result is the full sort's exactly.
    """
    if p >= 1.0:
        return probs
    k = candidates
    while True:
        if k < len(probs):
            floor = np.partition(probs, len(probs) - k)[len(probs) - k]  # the k-th largest
            chosen = np.flatnonzero(probs >= floor)  # ascending ids: ties stay in id order
        else:
            chosen = np.arange(len(probs))
        order = chosen[np.argsort(-probs[chosen], kind="stable")]
        mass = np.cumsum(probs[order])
        if mass[-1] >= p or len(chosen) == len(probs):
            break
        k *= 8
    # Keep each token whose preceding mass is still below p: the first always stays.
    keep = order[(mass - probs[order]) < p]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    return z / z.sum()


def sample(
    logits: np.ndarray,
    p: SamplingParams,
    rng: np.random.Generator,
    context: np.ndarray | None = None,
    completion: np.ndarray | None = None,
) -> int:
    """One token id from logits [vocab]."""
    empty = np.zeros(0, np.int64)
    context = empty if context is None else context
    z = apply_penalties(logits, p, context, empty if completion is None else completion)
    if p.greedy:
        return int(np.argmax(z))
    probs = top_p_probs(softmax(top_k_mask(z / p.temperature, p.top_k)), p.top_p)
    # Inverse CDF with one uniform draw: the same seed gives the same choice on every platform.
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))
