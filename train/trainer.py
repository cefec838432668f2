"""The trainer's parts as small functions: config, learning-rate schedule, optimizer, one
training step, validation loss. `train/fit.py` strings them into a run.

Gradient accumulation normalises by tokens, not by micro-batches: the loss of a step is the sum
of every micro-batch's token losses divided by the step's total target tokens, so k micro-
batches give exactly the gradient of one k-times batch (transformers PR #34191 is the bug this
avoids).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from train.dist import all_reduce_sum
from train.model import IGNORE_INDEX, ModelConfig

SCHEDULES = ("cosine", "wsd", "constant")
STRATEGIES = ("ddp", "fsdp")  # data parallelism under torchrun (train/dist.py)
DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class TrainConfig:
    """One run's settings. TOML: top-level keys below plus a `[model]` table."""

    model: ModelConfig = field(default_factory=ModelConfig)
    seq_len: int = 512
    batch_size: int = 8  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    steps: int = 1000
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = 100
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    dtype: str = "auto"  # autocast dtype; auto: bf16 on CUDA, and on CPUs whose bf16 is fast
    compile: bool = False
    device: str = "auto"
    strategy: str = "ddp"  # under torchrun: ddp, or fsdp (FSDP2 per block)
    activation_checkpointing: bool = False
    dist_timeout: float = 600.0  # seconds a collective may wait before the job stops
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0 disables periodic validation
    eval_batches: int = 8
    eval_task: str = ""  # optional NAME=PATH of a multiple-choice task scored at each validation
    eval_task_limit: int = 200  # the fixed first items of that task
    checkpoint_every: int = 200  # 0: only the final model
    keep_checkpoints: int = 3
    hourly_price: float = 3.0  # dollars per GPU-hour, for the cost estimate
    time_limit: float = 0.0  # seconds of training before stopping early; 0: none

    def __post_init__(self):
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_batches")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"seq_len ({self.seq_len}) exceeds model.max_position_embeddings "
                f"({self.model.max_position_embeddings})"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction must lie in (0, 1], got {self.decay_fraction}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.eval_task and "=" not in self.eval_task:
            raise ValueError(
                f"eval_task must be NAME=PATH, e.g. hellaswag=val.jsonl, got {self.eval_task!r}"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError("beta1 and beta2 must lie in [0, 1), eps must be > 0")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.time_limit < 0:
            raise ValueError("weight_decay, grad_clip and time_limit must be >= 0")

    @property
    def tokens_per_step(self) -> int:
        """Per process; a data-parallel step trains world_size times as many."""
        return self.batch_size * self.grad_accum * self.seq_len


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


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    """AdamW; weight decay on matrices only (not norms). Fused kernel where the device has it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, fused=device.type in ("cuda", "cpu"), **kwargs)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(groups, **kwargs)


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
    for group in optimizer.param_groups:
        group["lr"] = lr
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
