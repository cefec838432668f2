"""The verification suite's shared parts (VerifyConfig, Setup, CheckResult, the float64
reference twin) and the gradient-flow check (tied weights are in ties.py). Each check takes a
`Setup` (what the run will use) and returns one `CheckResult` row, leaving no trace on the
run's model (gradients cleared, weights never stepped). Parity is in parity.py, causal leak and
label shift in causal.py, step / accumulation / resume / throughput in steps.py, data and
tokenizer in inputs.py; suite.py runs them and writes the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from doel.train.dist import autocast, unwrap
from doel.train.gradflow import check_gradient_flow, step_loss
from doel.train.model import Llama, RMSNorm
from doel.train.settings import TrainConfig


@dataclass(frozen=True)
class VerifyConfig:
    """Thresholds of the suite (`doel-train verify --check key=value`). 0 or -1 means: the
    default described beside the field."""

    # fast path error <= factor x same-dtype eager error (+ floor). flash-attention uses 2 for
    # half-precision kernels; CPU SDPA flash in fp32 measured 3.3x math on trained weights,
    # the backward bugs this hunts are 5x (an error 5x the gradient itself) to 700x off.
    parity_factor: float = 5.0
    parity_rows: int = 2  # rows of the parity batch (batch > 1 on purpose)
    parity_max_len: int = 256  # the float64 reference runs on at most this many positions
    leak_positions: int = 4  # perturbed positions in the causal-leak check
    copy_steps: int = 30  # Adam steps of the copy task (8 rows of 15 tokens)
    copy_lr: float = 0.0  # Adam lr of the copy task; 0: min(1e-2, 3 x lr), less if wide
    copy_max_loss: float = 0.25  # nats on the copied tokens (chance: ln 16 = 2.77)
    resume_steps: int = 4  # N of "N steps == N/2 + save + load + N/2"
    # Rows of each micro-batch in the checks that train fresh models (step, resume): a second
    # and third model beside the run's own at its full micro-batch (16 x 2048 at 0.4B) would
    # not fit one GPU. The properties hold at any batch; the run's shape is timed elsewhere.
    fresh_rows: int = 4
    max_lost_updates: float = 0.01  # share of elements with a gradient that may stay put
    mfu_floor: float = 0.0  # forward and backward MFU floor; 0: 10 % on GPU, 0.2 % on CPU
    max_backward_ratio: float = 4.0  # backward time / forward time (about 2 when healthy)
    timing_reps: int = 5
    data_windows: int = 4096  # loader windows hashed for repeats (within one epoch)
    max_repeated_windows: float = 0.01
    max_val_overlap: float = -1.0  # -1: the max_val_overlap the shards were prepared with
    share_tolerance: float = 0.05  # |character share - requested share| per source
    tokenizer_docs: int = 300  # documents decoded from the shards for chars/token

    def __post_init__(self):
        for name in ("parity_rows", "parity_max_len", "leak_positions", "copy_steps", "fresh_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.parity_rows < 2:
            raise ValueError("parity_rows must be >= 2: some kernels fail only with batch > 1")
        if self.resume_steps < 2 or self.resume_steps % 2:
            raise ValueError(f"resume_steps must be even and >= 2, got {self.resume_steps}")
        if self.parity_factor < 1 or self.max_backward_ratio <= 0 or self.timing_reps < 1:
            raise ValueError("parity_factor >= 1, max_backward_ratio > 0, timing_reps >= 1")


@dataclass
class CheckResult:
    """One row of the report."""

    name: str
    checked: str  # what was checked, in a sentence
    passed: bool | None  # None: skipped (nothing to check here), with the reason in detail
    numbers: dict = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return {True: "pass", False: "FAIL", None: "skip"}[self.passed]


@dataclass(kw_only=True)
class Setup:
    """What the run will use. `model` is the eager module, `fwd` what the step calls (compiled
    when cfg.compile). The factories make fresh copies for checks that must step or train."""

    cfg: TrainConfig
    device: torch.device
    dtype: torch.dtype  # autocast dtype
    model: nn.Module
    fwd: nn.Module
    optimizer: torch.optim.Optimizer | None
    loader: object  # next_batch(), state_dict(), load_state_dict()
    data_dir: Path
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    make_loader: Callable[[], object]
    tokenizer: Path | None = None
    vcfg: VerifyConfig = field(default_factory=VerifyConfig)

    @classmethod
    def from_parts(cls, parts, data_dir, **overrides) -> Setup:
        """The Setup of what `build_parts` built: its objects and its factories, `overrides` taking
        the place of any field (a fresh-model factory, the tokenizer, thresholds)."""
        fields = dict(
            cfg=parts.cfg,
            device=parts.device,
            dtype=parts.dtype,
            model=parts.model,
            fwd=parts.compiled,
            optimizer=parts.optimizer,
            loader=parts.loader,
            data_dir=Path(data_dir),
            make_model=parts.make_model,
            make_optimizer=parts.make_optimizer,
            make_loader=parts.make_loader,
        )
        return cls(**(fields | overrides))

    def ctx(self):
        return autocast(self.device, self.dtype)

    def batches(self, n: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The run's next n batches, on the device, without consuming them from its loader."""
        return [(_tensor(x, self.device), _tensor(y, self.device)) for x, y in self.loader.peek(n)]

    def batch(self):
        return self.batches(1)[0]

    def fresh_batch(self):
        """The run's next batch cut to vcfg.fresh_rows rows: what a fresh model trains on."""
        return tuple(t[: self.vcfg.fresh_rows] for t in self.batch())


def fresh_like(model: nn.Module, device: torch.device) -> Callable[[], nn.Module]:
    """A factory of randomly initialised models of `model`'s class and config, on `device`, in
    its parameters' dtype: what the checks that step or train get, whatever weights the run
    started from."""
    p_dtype = next(model.parameters()).dtype

    def make() -> nn.Module:
        with torch.device(device):
            return type(model)(model.config).to(p_dtype)

    return make


def _tensor(a, device) -> torch.Tensor:
    return torch.as_tensor(a, device=device)


def rel_err(a: torch.Tensor | None, ref: torch.Tensor) -> float:
    """‖a - ref‖ / ‖ref‖ in float64; a missing tensor is 100 % wrong."""
    if a is None:
        return 1.0
    ref = ref.double()
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def low_precision(*dtypes: torch.dtype) -> torch.dtype:
    """The least precise of the dtypes (what bounds every tolerance)."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def param_dtype(model: nn.Module) -> torch.dtype:
    return low_precision(*(p.dtype for p in model.parameters()))


def is_tied(model: nn.Module) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    pairs = getattr(model, "tied_parameters", [])
    return bool(pairs) and all(a in params and params[a] is params.get(b) for a, b in pairs)


def _exact_rms(self, x):  # RMSNorm in the input's dtype: model.py's casts to float32
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def reference_twin(model: nn.Module, dtype: torch.dtype | None = None) -> Llama:
    """The project's plain Llama (train/model.py, no custom kernels) holding `model`'s weights,
    with the same ties, frozen parameters and (unless `dtype`) parameter dtypes. In float64 its
    norms and rotary tables are float64 too, so it is a true float64 reference."""
    inner = unwrap(model)
    cfg = dataclasses.replace(inner.config, tie_word_embeddings=is_tied(inner))
    device = next(inner.parameters()).device
    with torch.device(device):
        twin = Llama(cfg)
    src = dict(inner.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, p in twin.named_parameters(remove_duplicate=False):
            p.data = src[name].detach().to(dtype or src[name].dtype).clone()
            p.requires_grad_(src[name].requires_grad)
    if dtype == torch.float64:
        d = cfg.head_dim
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1).to(device)
        twin.rope_cos, twin.rope_sin = emb.cos(), emb.sin()
        for m in twin.modules():
            if isinstance(m, RMSNorm):
                m.forward = types.MethodType(_exact_rms, m)
    return twin


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    # Names as the inner model has them: a compiled or DDP-wrapped model's carry a prefix.
    out = {
        strip_prefix(n): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return out


def loss_pass(model, x, y, ctx, backend=None) -> dict[str, torch.Tensor]:
    kernel = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    with kernel, ctx():
        loss = model(x, y, reduction="sum") / y.numel()
    loss.backward()
    return {"loss": loss.detach().float().reshape(1), **grads_of(model)}


# ------------------------------------------------------------------ 1. gradient flow


def check_gradients(s: Setup) -> CheckResult:
    x, y = s.batch()
    # ties=[]: tie identity is the `ties` check's job, so each failure has one owner.
    r = check_gradient_flow(s.fwd, (x, y), loss_fn=step_loss(s.ctx), ties=[])
    norms = list(r.norms.values())
    return CheckResult(
        "gradient_flow",
        "every trainable parameter gets a finite, nonzero gradient (one real batch, the run's "
        "model, dtype and compile setting)",
        r.ok,
        {
            "parameters": r.checked,
            "loss": r.loss,
            "offenders": len(r.offenders),
            "min_grad_norm": min(norms) if norms else float("nan"),
            "max_grad_norm": max(norms) if norms else float("nan"),
        },
        "; ".join(f"{n}: {why}" for n, why in r.offenders[:6])
        or "every trainable parameter has a finite, nonzero gradient",
    )


# ------------------------------------------------------------------ 3. tied weights


def strip_prefix(name: str) -> str:
    while name.startswith(("_orig_mod.", "module.")):
        name = name.split(".", 1)[1]
    return name
