"""Log-probabilities for `/v1/completions`' `logprobs` and `echo`: the model's own distribution
(raw logits, before temperature or penalties, as OpenAI and vLLM report it), in OpenAI's legacy
completions shape.

The normalizer is summed in float64 (see `logsumexp`): a scorer adds up hundreds of these, and a
float32 sum over a 32k vocabulary loses the digits a log-likelihood comparison looks at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

MAX_TOP = 5  # top log-probabilities per position, as OpenAI caps `logprobs`
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token's vocabulary piece


@dataclass(frozen=True)
class Scored:
    """One position: the log-probability of its token and the `top` most likely ids."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass
class Record:
    """What a sequence's scheduler step writes when a request asks for log-probabilities:
    `entries[i]` scores token i of prompt + completion (the prompt's only with `prompt`; the
    first prompt token has no context, so None)."""

    top: int
    prompt: bool
    entries: list[Scored | None] = field(default_factory=list)


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis, as float64. The max is taken out first, so every term
    is at most 1; the terms are taken in the logits' dtype (float32: each within 1.2e-7
    relative) and summed in float64, where a float32 sum over 32k terms would lose digits. Half
    the time of a float64 softmax, and within 1e-6 of it (tests/serve/core/test_logprobs.py)."""
    x = np.atleast_2d(logits)
    m = x.max(axis=-1, keepdims=True)
    total = np.exp(x - m).sum(axis=-1, dtype=np.float64)
    return m[..., 0].astype(np.float64) + np.log(total)


def score_rows(logits: np.ndarray, targets, top: int) -> list[Scored]:
    """Row r of logits [n, vocab] scored at targets[r], with its `top` most likely ids
    (most likely first; equal ones by id). All rows at once: a 2,048-token prompt is 2,048
    rows of the vocabulary."""
    x = np.atleast_2d(logits)[: len(targets)]
    lse = logsumexp(x)
    rows = np.arange(len(x))
    picked = (x[rows, np.asarray(targets, np.int64)].astype(np.float64) - lse).tolist()
    if not top:
        return [Scored(p, (), ()) for p in picked]
    # log softmax keeps the order of the logits: the top ones are chosen on the logits (among
    # equal ones at the cut, argpartition's choice).
    if top == 1:  # lm-eval's ask: argmax is a fraction of a partition's time
        part = x.argmax(axis=1)[:, None]
    else:
        part = np.argpartition(x, x.shape[1] - top, axis=1)[:, -top:]
    vals = np.take_along_axis(x, part, axis=1).astype(np.float64) - lse[:, None]
    order = np.lexsort((part, -vals), axis=1)  # by log-probability, then by id
    ids = np.take_along_axis(part, order, axis=1).tolist()
    vals = np.take_along_axis(vals, order, axis=1).tolist()
    return [Scored(p, tuple(i), tuple(v)) for p, i, v in zip(picked, ids, vals)]


def _texts(tokenizer, ids: list[int]) -> tuple[list[str], list[int]]:
    """Each token's text and its character offset in the decoded text. A run of byte tokens
    (one character's UTF-8 split by byte fallback) decodes as a whole; each of its tokens is
    spelled as OpenAI spells a byte ("bytes:\\xe0") and sits at the run's offset."""
    pieces = [tokenizer.id_to_token(i) or "" for i in ids]
    shown = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    texts, offsets, pos, i = [], [], 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and BYTE_PIECE.fullmatch(pieces[j]):
            j += 1
        if j > i:  # bytes i..j-1
            for k in range(i, j):
                texts.append("bytes:\\x" + BYTE_PIECE.fullmatch(pieces[k])[1].lower())
                offsets.append(pos)
            pos += len(tokenizer.decode(ids[i:j]))
            i = j
            continue
        texts.append(shown[i])
        offsets.append(pos)
        pos += len(tokenizer.decode([ids[i]]))  # a special token adds no text
        i += 1
    return texts, offsets


def openai_logprobs(tokenizer, ids: list[int], entries: list[Scored | None], start: int) -> dict:
    """`choices[i].logprobs` for tokens ids[start:] (entries aligned with ids): tokens,
    token_logprobs, top_logprobs ({token text: logprob}), text_offset; offsets count from the
    first listed token."""
    texts, offsets = _texts(tokenizer, ids[start:])
    names = {}
    for e in entries[start:]:
        for i in e.top_ids if e else ():
            names.setdefault(i, None)
    if names:
        for i, t in zip(names, _texts(tokenizer, list(names))[0]):
            names[i] = t
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob if e else None for e in entries[start:]],
        "top_logprobs": [_top(names, e) if e else None for e in entries[start:]],
        "text_offset": offsets,
    }


def _top(names: dict[int, str], e: Scored) -> dict[str, float]:
    """{text: logprob}, most likely first; of two ids with one text, the likelier is kept."""
    top: dict[str, float] = {}
    for i, lp in zip(e.top_ids, e.top_logprobs):
        top.setdefault(names[i], lp)
    return top
