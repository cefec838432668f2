"""The verification suite's run checks: one optimizer step moves every parameter, gradient
accumulation equals one big batch, resume equals an uninterrupted run, the throughput floor,
the data (overlap, repeated windows, language shares) and the tokenizer's fairness. Checks
that step or train use fresh models from the run's factories, never the run's own objects.
"""

from __future__ import annotations

import hashlib
import tempfile
import time

import numpy as np
import torch

from doel.train.checkpoint import load_checkpoint, save_checkpoint
from doel.train.checks.base import CheckResult, Setup, low_precision, param_dtype, rel_err
from doel.train.dist import unwrap
from doel.train.metrics import mfu, peak_flops
from doel.train.model import IGNORE_INDEX
from doel.train.optim import set_lr
from doel.train.step import lr_at, micro_batches_per_update, take_step, train_step

# ------------------------------------------------------------------ 5. one step moves everything


def one_step(s: Setup):
    """A fresh model of the run's recipe stepped once as train_step does it (token-normalised
    loss, clipping, the lr of step 1). Returns the model, its weights before, its gradients."""
    torch.manual_seed(s.cfg.seed)
    model = s.make_model()
    opt = s.make_optimizer(model)
    x, y = s.fresh_batch()  # vcfg.fresh_rows rows: beside the run's model on one GPU
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with s.ctx():
        loss = model(x, y, reduction="sum") / int((y != IGNORE_INDEX).sum())
    loss.backward()
    if s.cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.cfg.grad_clip)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    set_lr(opt, lr_at(0, s.cfg))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, before, grads


def check_step(s: Setup) -> CheckResult:
    """Every trainable tensor must move in one step, and (almost) every element with a nonzero
    gradient must move: an update that rounds away in bf16 leaves it where it was."""
    model, before, grads = one_step(s)
    bad, unchanged, ratios, frozen = [], [], {}, []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            frozen.append(n)  # the gradient-flow check owns frozen parameters
            continue
        moved = p.detach() != before[n]
        if not moved.any():
            unchanged.append(n)
            continue
        should = grads[n] != 0 if n in grads else torch.zeros_like(moved)
        lost = float((should & ~moved).sum() / should.sum().clamp_min(1))
        ratios[n] = float((p.detach() - before[n]).float().norm() / before[n].float().norm())
        if lost > s.vcfg.max_lost_updates:
            bad.append(f"{n}: {lost:.1%} of the elements with a gradient did not move")
    dtype = str(param_dtype(model)).replace("torch.", "")
    if unchanged:
        shown = ", ".join(unchanged[:6]) + (
            f" (+{len(unchanged) - 6} more)" if len(unchanged) > 6 else ""
        )
        bad.insert(
            0,
            f"unchanged after one step: {shown} (not in the optimizer, or the update "
            f"rounds away in {dtype})",
        )
    numbers = {
        "tensors": len(before) - len(frozen),
        "unchanged": len(unchanged),
        "frozen_not_judged": len(frozen),
        "update_over_weight_min": min(ratios.values(), default=float("nan")),
        "update_over_weight_max": max(ratios.values(), default=float("nan")),
        "lr": lr_at(0, s.cfg),
        "param_dtype": dtype,
    }
    return CheckResult(
        "step",
        "one optimizer step (the run's optimizer recipe, lr of step 1) changes every trainable "
        "parameter, and no element with a gradient keeps its value",
        not bad,
        numbers,
        "; ".join(bad[:4]) or "every trainable parameter moved",
    )


# ------------------------------------------------------------------ 6. accumulation


class _GradCapture:
    """Stands in for the optimizer in train_step: keeps the gradients instead of stepping."""

    def __init__(self, model):
        self.model, self.grads = model, {}
        self.param_groups = [{"params": [p for p in model.parameters()], "lr": 0.0}]

    def step(self):
        self.grads = {
            n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None
        }

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def check_accumulation(s: Setup) -> CheckResult:
    """train_step over 2 micro-batches (uneven target counts) against one twice-as-big batch."""
    # Two micro-batches of at most 4 rows: the property holds for any k, and one k-times batch
    # of the run's own micro-batches (16 x 2048 x 16 at 0.4B) would not fit in memory.
    k = 2
    micro = [(x[:4], y[:4]) for x, y in s.batches(k)]
    x0, y0 = micro[0]
    y0 = y0.clone()
    y0[0, : y0.size(1) // 2] = IGNORE_INDEX  # uneven tokens: a mean of means would be wrong
    micro[0] = (x0, y0)
    model = unwrap(s.fwd)  # eager: a second batch shape would only recompile
    cap = _GradCapture(model)
    small = train_step(model, cap, micro, 0.0, 0.0, s.ctx)
    g_small = cap.grads
    whole = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]
    big = train_step(model, cap, whole, 0.0, 0.0, s.ctx)
    errs = {n: rel_err(g_small.get(n), g) for n, g in cap.grads.items()}
    worst = max(errs, key=errs.get)
    tol = max(1e-5, 8 * torch.finfo(low_precision(s.dtype, param_dtype(model))).eps)
    loss_err = abs(float(small["loss"]) - float(big["loss"])) / abs(float(big["loss"]))
    ok = errs[worst] <= tol and loss_err <= tol
    return CheckResult(
        "accumulation",
        f"{k} micro-batches with uneven target counts give the gradient and loss of one "
        f"{k}-times batch (train_step's token normalisation)",
        ok,
        {
            "micro_batches": k,
            "worst_tensor": worst,
            "grad_error": errs[worst],
            "loss_error": loss_err,
            "tolerance": tol,
        },
        "gradients and loss match"
        if ok
        else f"{worst}: gradient {errs[worst]:.2%} off, loss {loss_err:.2%} off (tolerance "
        f"{tol:.0e}); the loss is likely averaged per micro-batch instead of per token",
    )


# ------------------------------------------------------------------ 7. resume


def _window_hash(x, y) -> str:
    return hashlib.blake2b(
        np.ascontiguousarray(x).tobytes() + np.asarray(y).tobytes(), digest_size=8
    ).hexdigest()


def _train(s: Setup, model, opt, loader, start: int, steps: int):
    losses, seen = [], []
    for step in range(start, start + steps):
        raw = [loader.next_batch() for _ in range(s.cfg.grad_accum)]
        seen.append("".join(_window_hash(x, y) for x, y in raw))
        rows = s.vcfg.fresh_rows  # two fresh models at the run's micro-batch would not fit
        mbs = [
            (
                torch.as_tensor(x[:rows], device=s.device),
                torch.as_tensor(y[:rows], device=s.device),
            )
            for x, y in raw
        ]
        per_update = micro_batches_per_update(step, s.cfg)  # the run's, ramp included
        out = take_step(model, opt, mbs, per_update, lr_at(step, s.cfg), s.cfg.grad_clip, s.ctx)
        losses.append(float(out["loss"]))
    return losses, seen


def _fresh(s: Setup, seed: int):
    torch.manual_seed(seed)
    model = s.make_model()
    return model, s.make_optimizer(model), s.make_loader()


def resumed_run(s: Setup, half: int):
    """half steps, save_checkpoint, then a fresh model, optimizer and loader (another seed, so
    whatever they know must come from the checkpoint) loaded and trained half more steps."""
    model_b, opt_b, loader_b = _fresh(s, s.cfg.seed)
    loss_b, seen_b = _train(s, model_b, opt_b, loader_b, 0, half)
    with tempfile.TemporaryDirectory(prefix="doel-verify-") as tmp:
        folder = save_checkpoint(tmp, half, model_b, opt_b, {"loader": loader_b.state_dict()})
        del model_b, opt_b  # a full-size optimizer state: free it before the next model
        model_c, opt_c, loader_c = _fresh(s, s.cfg.seed + 1)
        _, state = load_checkpoint(folder, model_c, opt_c, device=s.device)
        loader_c.load_state_dict(state["loader"])
        loss_c, seen_c = _train(s, model_c, opt_c, loader_c, half, half)
    return model_c, loss_b + loss_c, seen_b + seen_c


def check_resume(s: Setup) -> CheckResult:
    n = s.vcfg.resume_steps
    half = n // 2
    model_a, opt_a, loader_a = _fresh(s, s.cfg.seed)
    loss_a, seen_a = _train(s, model_a, opt_a, loader_a, 0, n)
    del opt_a, loader_a
    model_c, loss_c, seen_c = resumed_run(s, half)
    a = dict(model_a.named_parameters())
    errs = {n_: rel_err(p.detach(), a[n_].detach()) for n_, p in model_c.named_parameters()}
    worst = max(errs, key=errs.get)
    exact = s.device.type == "cpu"  # CUDA kernels may reduce in a different order
    tol = 0.0 if exact else 1e-3
    batches_ok = seen_a == seen_c
    ok = batches_ok and errs[worst] <= tol
    detail = []
    if not batches_ok:
        first_diff = next(i for i, (p, q) in enumerate(zip(seen_a, seen_c)) if p != q)
        detail.append(
            f"the resumed run saw different batches from step {first_diff + 1} on: "
            "the loader's position was not restored"
        )
    if errs[worst] > tol:
        detail.append(f"weights differ after {n} steps ({worst}: {errs[worst]:.2e} relative)")
    return CheckResult(
        "resume",
        f"{n} steps == {half} + save_checkpoint + load_checkpoint (fresh model, optimizer, "
        f"loader) + {half}: same batches, same losses, same weights"
        + (" (bit for bit on CPU)" if exact else ""),
        ok,
        {
            "steps": n,
            "losses_whole": loss_a,
            "losses_resumed": loss_c,
            "max_weight_error": errs[worst],
            "tolerance": tol,
            "same_batches": batches_ok,
        },
        "; ".join(detail) or "the resumed run is the uninterrupted run",
    )


# ------------------------------------------------------------------ 8. throughput


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward_backward(s: Setup, x, y, reps: int) -> tuple[float, float]:
    """Fastest seconds of the forward (to the loss) and of the backward, timed apart and
    interleaved, after two warm-up passes (compilation, kernel selection). The fastest, not the
    median: other processes only ever add time.

    On a GPU, wall time. On a CPU, the process's CPU time with one intra-op thread. On a loaded
    CPU, wall time also counts the time other processes hold the cores, and with several threads
    each parallel region waits until its last thread is scheduled again; the backward has more
    such regions than the forward, so even the best of the repeats of a healthy model's backward
    read many times its forward while two other processes kept both cores busy. CPU time counts
    only the work done, by any thread of the process (a compiled graph may keep threads of its
    own); one thread leaves none to wait for, nor one spinning at a barrier, which CPU time
    would count. A slow kernel is as slow on one thread."""
    cpu = s.device.type == "cpu"
    clock = time.process_time if cpu else time.perf_counter
    threads = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)
    fwd_t, bwd_t = [], []
    try:
        for i in range(reps + 2):
            _sync(s.device)
            t0 = clock()
            with s.ctx():
                loss = s.fwd(x, y, reduction="sum") / y.numel()
            _sync(s.device)
            t1 = clock()
            loss.backward()
            _sync(s.device)
            t2 = clock()
            s.fwd.zero_grad(set_to_none=True)
            if i >= 2:
                fwd_t.append(t1 - t0)
                bwd_t.append(t2 - t1)
    finally:
        torch.set_num_threads(threads)
    return min(fwd_t), min(bwd_t)


def check_throughput(s: Setup) -> CheckResult:
    x, y = s.batch()
    t_f, t_b = time_forward_backward(s, x, y, s.vcfg.timing_reps)
    inner = unwrap(s.fwd)
    flops = inner.flops_per_token(x.size(1))["total"]  # training: 1/3 forward, 2/3 backward
    compute = param_dtype(inner)
    compute = s.dtype if torch.finfo(compute).bits >= 32 else compute
    peak, source = peak_flops(s.device, compute)
    if peak and s.device.type == "cpu":  # timed on one thread: against one thread's share
        peak, source = peak / torch.get_num_threads(), f"{source}, a thread's share"
    floor = s.vcfg.mfu_floor or (0.10 if s.device.type == "cuda" else 0.002)
    tokens = x.numel()
    mfu_f = mfu(tokens / t_f, flops / 3, peak)
    mfu_b = mfu(tokens / t_b, flops * 2 / 3, peak)
    ratio = t_b / t_f
    bad = []
    if peak and mfu_f < floor:
        bad.append(f"forward at {mfu_f:.2%} of peak, under the {floor:.1%} floor")
    if peak and mfu_b < floor:
        bad.append(f"backward at {mfu_b:.2%} of peak, under the {floor:.1%} floor")
    if ratio > s.vcfg.max_backward_ratio:
        bad.append(
            f"backward takes {ratio:.1f}x the forward (healthy is about 2, limit "
            f"{s.vcfg.max_backward_ratio:g}): a slow backward kernel"
        )
    return CheckResult(
        "throughput",
        "forward and backward timed apart on one real batch: MFU of each against the device "
        f"peak ({source}) and the backward/forward time ratio",
        not bad,
        {
            "forward_s": t_f,
            "backward_s": t_b,
            "forward_mfu": mfu_f,
            "backward_mfu": mfu_b,
            "backward_over_forward": ratio,
            "mfu_floor": floor,
            "peak_flops": peak,
            "flops_per_token": flops,
            "tokens": tokens,
        },
        "; ".join(bad) or "forward and backward above the floor",
    )
