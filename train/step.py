"""One step of training as small functions: the learning-rate schedule, one optimizer update
(`train_step`), one step of a run (`take_step`: one update, or several in a batch ramp), the
validation loss. They take a `TrainConfig` and an optimizer built elsewhere; the step loop calls
them.

Gradient accumulation normalises by tokens, not by micro-batches: the loss of a step is the sum
of every micro-batch's token losses divided by the step's total target tokens, so k micro-
batches give exactly the gradient of one k-times batch (transformers PR #34191 is the bug this
avoids).

A batch-size ramp (`batch_ramp_fraction`) splits a step, never the data: every step is still
grad_accum micro-batches, read in the same order, but over the first fraction of the steps they
make several optimizer updates of fewer micro-batches each (`micro_batches_per_update`,
`take_step`). A step is thus a fixed number of tokens, not one update: steps, warmup_steps, the
lr schedule, log_every, eval_every, checkpoint_every and the checkpoints' names count these
steps, so a ramp changes neither a run's tokens nor where it resumes.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from doel.train.dist import all_reduce_sum
from doel.train.model import IGNORE_INDEX
from doel.train.optim import set_lr
from doel.train.settings import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to
    lr·min_lr_ratio, or warmup-stable-decay (constant, then linear over the last
    decay_fraction of steps), or constant."""
    peak, low = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
        return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_start = cfg.steps - max(1, round(cfg.decay_fraction * cfg.steps))
    if step < decay_start:
        return peak
    progress = (step - decay_start) / max(1, cfg.steps - 1 - decay_start)
    return peak + (low - peak) * min(progress, 1.0)


def micro_batches_per_update(step: int, cfg: TrainConfig) -> int:
    """Micro-batches in each optimizer update of step `step` (0-based): grad_accum, except over
    the first batch_ramp_fraction of the steps, where the update's batch grows linearly from
    one micro-batch towards grad_accum, rounded down to a divisor of grad_accum (so that a
    step holds whole updates)."""
    ramp = round(cfg.batch_ramp_fraction * cfg.steps)
    if step >= ramp:
        return cfg.grad_accum
    target = 1 + (cfg.grad_accum - 1) * step / ramp
    return max(d for d in range(1, cfg.grad_accum + 1) if cfg.grad_accum % d == 0 and d <= target)


def updates_before(step: int, cfg: TrainConfig) -> int:
    """Optimizer updates made by the steps before `step` (a resumed run's count)."""
    ramp = min(step, round(cfg.batch_ramp_fraction * cfg.steps))
    ramped = sum(cfg.grad_accum // micro_batches_per_update(s, cfg) for s in range(ramp))
    return ramped + step - ramp


def take_step(
    model, optimizer, micro_batches, per_update: int, lr: float, grad_clip=1.0, ctx=None
) -> dict:
    """One step of a run: its micro-batches in consecutive optimizer updates of `per_update`
    each (train_step each, at the same lr). Returns train_step's loss (the mean over the whole
    step's target tokens) and tokens, the last update's grad_norm, and `updates`."""
    ctx = ctx or contextlib.nullcontext
    if per_update >= len(micro_batches):
        return train_step(model, optimizer, micro_batches, lr, grad_clip, ctx) | {"updates": 1}
    outs = [
        train_step(model, optimizer, micro_batches[i : i + per_update], lr, grad_clip, ctx)
        for i in range(0, len(micro_batches), per_update)
    ]
    tokens = torch.stack([o["tokens"] for o in outs]).sum()
    loss = torch.stack([o["loss"] * o["tokens"] for o in outs]).sum() / tokens
    return {
        "loss": loss,
        "grad_norm": outs[-1]["grad_norm"],
        "tokens": tokens,
        "updates": len(outs),
    }


def _no_sync(model, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch (DDP and FSDP2)."""
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        return _ResyncAfter(model)
    return contextlib.nullcontext()


class _ResyncAfter(contextlib.AbstractContextManager):
    def __init__(self, model):
        self.model = model

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def train_step(
    model, optimizer, micro_batches, lr: float, grad_clip: float = 1.0, ctx=contextlib.nullcontext
) -> dict:
    """One optimizer step over a list of (inputs, targets) micro-batches already on the device.
    The loss is normalised by the target tokens of the whole step across all ranks (DDP and
    FSDP average gradients over ranks, hence the world-size factor). Returns loss (mean nats
    per target token), grad_norm and tokens (global), all tensors on the device."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Counted on the device: an int() here would make the host wait for the GPU once per
    # micro-batch. A step without any target gives a NaN loss, which the run stops on.
    local = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches]).sum()
    n_tokens = all_reduce_sum(local.float())
    total = None
    for i, (x, y) in enumerate(micro_batches):
        with _no_sync(model, last=i == len(micro_batches) - 1):
            with ctx():
                loss_sum = model(x, y, reduction="sum")
            (loss_sum * (world / n_tokens)).backward()
        total = loss_sum.detach() if total is None else total + loss_sum.detach()
    total = all_reduce_sum(total.float())
    # max_norm=inf measures without clipping; works on DTensor (FSDP) gradients too.
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), grad_clip if grad_clip > 0 else float("inf")
    )
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    set_lr(optimizer, lr)  # times each group's lr_scale (Muon's own rate)
    optimizer.step()
    # The model's zero_grad, not only the optimizer's: a parameter the optimizer lacks must
    # not pile up gradient from step to step (and inflate the clipping norm).
    model.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    return {"loss": total / n_tokens, "grad_norm": grad_norm, "tokens": n_tokens}


@torch.no_grad()
def validation_loss(model, batches, device, ctx=contextlib.nullcontext) -> float:
    """Mean nats per target token over (inputs, targets) numpy/tensor batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)
        with ctx():
            total += float(model(x, y, reduction="sum"))
        count += int((y != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / max(count, 1)
