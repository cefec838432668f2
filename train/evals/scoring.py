"""Multiple-choice scoring by log-likelihood: the sum of the continuation's token log-probabilities
given the context, batched, on any device; accuracy, length-normalised accuracy (log-likelihood
per character, lm-eval's acc_norm), bootstrap standard errors and the chance level.

Tokenization is lm-evaluation-harness's (`HFLM._encode_pair`, read in lm-eval 0.4.13), so the two
score the same tokens (tests/train/test_tasks.py checks it item by item): trailing spaces of the
context move to the continuation; context and context + continuation are each encoded with the
tokenizer's <|bos|>, and the continuation is what the whole has beyond the context's length; an
input longer than the model's context is cut from the left.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from doel.train.common import DoelError
from doel.train.dist import unwrap
from doel.train.evals.tasks import Item, load_task
from doel.train.model import Llama

Request = tuple[str, str]


def encode_requests(tokenizer, requests: Sequence[Request]) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) of each request, split as lm-eval splits them."""
    pairs = []
    for ctx, cont in requests:
        n = len(ctx) - len(ctx.rstrip())
        pairs.append((ctx[: len(ctx) - n], ctx[len(ctx) - n :] + cont))
    contexts = sorted({c for c, _ in pairs if c})
    ctx_ids = dict(zip(contexts, (e.ids for e in tokenizer.encode_batch(contexts))))
    wholes = tokenizer.encode_batch([c + k for c, k in pairs])
    bare = tokenizer.encode_batch([k for _, k in pairs], add_special_tokens=False)
    out = []
    for (ctx, _), whole, alone in zip(pairs, wholes, bare):
        if ctx:
            c = ctx_ids[ctx]
            out.append((c, whole.ids[len(c) :]))
        else:  # no context: <|bos|> is the context, the continuation encoded without it
            out.append(([tokenizer.token_to_id("<|bos|>")], alone.ids))
    return out


def _hidden(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    """`model(idx)` up to the final norm, (B, T, C). The head (C x V, more than half of a small
    model's FLOPs per token) then runs only at the scored positions; a test checks the result
    against full `model(idx)` logits."""
    T = idx.size(1)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.model.embed_tokens(idx)
    for block in model.model.layers:
        x = block(x, cos, sin)
    return model.model.norm(x)


def _target_logprobs(model: Llama, h: torch.Tensor, targets: torch.Tensor, chunk: int = 1024):
    """log P(target) at each of the N rows of h (N, C), through the head `chunk` rows at a time:
    N x V float32 logits for long continuations would be gigabytes."""
    out = []
    for hc, tc in zip(h.split(chunk), targets.split(chunk)):
        logp = F.log_softmax(model.lm_head(hc).float(), dim=-1)  # (chunk, V)
        out.append(logp.gather(1, tc[:, None])[:, 0])
    return torch.cat(out)


def _batches(lengths: list[int], batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Indices longest first, cut into batches of at most batch_size rows and (rows x longest
    row) max_batch_tokens tokens: similar lengths share a batch, so little is padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size:
            width = lengths[batches[-1][0]]
            if (len(batches[-1]) + 1) * width <= max_batch_tokens:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


@torch.no_grad()
def loglikelihoods(
    model: Llama,
    tokenizer,
    requests: Sequence[Request],
    batch_size: int = 16,
    max_batch_tokens: int = 8192,
    device=None,
    progress: bool = False,
    cut: list[int] | None = None,
) -> list[float]:
    """log P(continuation | context) in nats for each (context, continuation) request. A
    request longer than the model's context is cut from the left, as lm-eval cuts it (the
    window is the last context + 1 tokens); a continuation longer than the context itself is
    scored on its last tokens that fit. `cut` gets the indices of the requests cut."""

    model = unwrap(model)  # torch.compile / DDP wrappers: score with the eager module inside
    limit = model.config.max_position_embeddings
    seqs = []
    for n, (ctx, cont) in enumerate(encode_requests(tokenizer, requests)):
        if not cont:
            raise DoelError(f"request {n}: continuation {requests[n][1]!r} has no tokens")
        full = (ctx + cont)[-(limit + 1) :]
        seqs.append((full[:-1], full[-min(len(cont), limit) :]))
        if cut is not None and len(ctx) + len(cont) > limit + 1:
            cut.append(n)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    pad = model.config.pad_token_id
    out = [0.0] * len(seqs)
    was_training = model.training
    model.eval()
    off = None if progress else True  # None: off whenever stderr is not a terminal
    bar = tqdm(total=len(seqs), desc="scoring choices", unit="req", disable=off)
    try:
        for batch in _batches([len(s[0]) for s in seqs], batch_size, max_batch_tokens):
            x = torch.full((len(batch), len(seqs[batch[0]][0])), pad, dtype=torch.long)
            rows, cols, targets = [], [], []
            for r, i in enumerate(batch):
                inp, tgt = seqs[i]
                # Right padding is safe: causal attention keeps real positions from seeing it.
                x[r, : len(inp)] = torch.tensor(inp)
                rows += [r] * len(tgt)
                cols += range(len(inp) - len(tgt), len(inp))
                targets += tgt
            h = _hidden(model, x.to(device))[rows, cols]  # (N, C): the scored positions only
            picked = _target_logprobs(model, h, torch.tensor(targets, device=device)).cpu()
            sums = torch.zeros(len(batch)).index_add_(0, torch.tensor(rows), picked)
            for r, i in enumerate(batch):
                out[i] = float(sums[r])
            bar.update(len(batch))
    finally:
        bar.close()
        model.train(was_training)
    return out


def score_items(model: Llama, tokenizer, items: Sequence[Item], **kw) -> list[list[float]]:
    """The log-likelihood of every choice of every item (kw: as `loglikelihoods`; its `cut`
    gets the indices of the items, not requests, cut to fit the context)."""
    cut, requests = kw.pop("cut", None), [r for it in items for r in it.requests]
    cut_requests: list[int] = []
    flat = loglikelihoods(model, tokenizer, requests, cut=cut_requests, **kw)
    if cut is not None:
        owner = [i for i, it in enumerate(items) for _ in it.requests]
        cut += sorted({owner[n] for n in cut_requests})
    out, k = [], 0
    for it in items:
        out.append(flat[k : k + len(it.requests)])
        k += len(it.requests)
    return out


def predictions(items: Sequence[Item], lls: Sequence[Sequence[float]]) -> tuple[list, list]:
    """Chosen index per item by log-likelihood and by log-likelihood per character (the first
    of equals, as np.argmax, which lm-eval uses)."""
    pred = [int(np.argmax(ll)) for ll in lls]
    # max(.., 1): an empty choice would divide by zero; lm-eval has none in these tasks.
    norm = [int(np.argmax(np.array(ll) / np.maximum(it.lengths, 1))) for it, ll in zip(items, lls)]
    return pred, norm


def bootstrap_stderr(correct: Sequence[bool], n_boot: int = 10_000, seed: int = 0) -> float:
    """Bootstrap standard error of a mean of 0/1 outcomes. Resampling n outcomes with k
    successes gives Binomial(n, k/n) successes exactly, so that is drawn instead of indices."""
    n = len(correct)
    if n < 2:
        return float("nan")
    draws = np.random.default_rng(seed).binomial(n, sum(correct) / n, size=n_boot) / n
    return float(draws.std(ddof=1))


def summarize(items: Sequence[Item], lls: Sequence[Sequence[float]], seed: int = 0) -> dict:
    """acc and acc_norm with bootstrap standard errors, the chance level (mean 1/choices) and
    the majority baseline: the accuracy of always picking the most frequent gold position. A
    model that prefers one letter ("C") or one word ("no") scores that, not chance, on sets
    whose answers are unevenly placed (CommonsenseQA's letters, BoolQ's yes/no)."""
    pred, norm = predictions(items, lls)
    acc = [p == it.gold for p, it in zip(pred, items)]
    acc_norm = [p == it.gold for p, it in zip(norm, items)]
    n = len(items)
    return {
        "items": n,
        "acc": sum(acc) / n if n else float("nan"),
        "acc_stderr": bootstrap_stderr(acc, seed=seed),
        "acc_norm": sum(acc_norm) / n if n else float("nan"),
        "acc_norm_stderr": bootstrap_stderr(acc_norm, seed=seed),
        "chance": sum(1 / len(it.requests) for it in items) / n if n else float("nan"),
        "majority": max(Counter(it.gold for it in items).values()) / n if n else float("nan"),
    }


def task_accuracy(
    model: Llama,
    tokenizer,
    items: Sequence[Item],
    batch_size: int = 16,
    max_batch_tokens: int = 8192,
    device=None,
    progress: bool = False,
) -> dict:
    """Zero-shot accuracy of `model` on items (from `train.evals.tasks.load_task`): items, acc,
    acc_stderr, acc_norm, acc_norm_stderr, chance, and `truncated`: the items longer than the
    model's context, scored cut from the left. Leaves the model's train/eval mode as it was."""
    cut: list[int] = []
    lls = score_items(
        model,
        tokenizer,
        items,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        device=device,
        progress=progress,
        cut=cut,
    )
    return summarize(items, lls) | {"truncated": len(cut)}


def run_tasks(
    model: Llama,
    tokenizer,
    tasks: dict[str, str],
    limit: int | None = None,
    batch_size: int = 16,
    progress: bool = True,
) -> dict[str, dict]:
    """`task_accuracy` for each {name: path} (the first `limit` items of each)."""
    results = {}
    for name, path in tasks.items():
        items = load_task(name, path, limit)
        results[name] = {"path": str(path)} | task_accuracy(
            model, tokenizer, items, batch_size=batch_size, progress=progress
        )
    return results


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_num(x, fmt: str) -> str:
    """x formatted, or "n/a" when it is missing or not finite (nothing to divide by): a table
    a person reads never shows "nan"."""
    return format(x, fmt) if _finite(x) else "n/a"


def _acc(r: dict, key: str) -> str:
    """Accuracy ± its standard error; the error is left out where one item cannot give it."""
    se = r.get(f"{key}_stderr")
    return fmt_num(r[key], ".3f") + (f" ± {se:.3f}" if _finite(se) else "")


def format_tasks(results: dict[str, dict]) -> str:
    """A Markdown table: accuracy and length-normalised accuracy ± standard error, chance and
    the majority baseline ("n/a" where there is nothing to measure)."""
    lines = [
        "| task | items | acc | acc_norm | chance | majority |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['items']:,} | {_acc(r, 'acc')} | {_acc(r, 'acc_norm')} "
            f"| {fmt_num(r['chance'], '.3f')} | {fmt_num(r.get('majority'), '.3f')} |"
        )
    for name, r in results.items():
        if r.get("truncated"):
            lines.append(
                f"\n{name}: {r['truncated']:,} of {r['items']:,} items were longer than the "
                "model's context and were scored cut from the left, as lm-evaluation-harness does"
            )
    return "\n".join(lines)
