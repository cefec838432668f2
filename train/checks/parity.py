"""The parity check: every fast path the run uses against a float64 reference, forward and
backward, by the flash-attention rule (the fast path's error may be at most a small factor times
the error of the same-dtype eager implementation, both measured against float64): each SDPA
backend against math, the model's own modules (custom or fused kernels) against the plain model
in train/model.py, torch.compile against eager, the fused (or foreach) AdamW against the
for-loop one, and Muon (when the run uses it) against our float64 update (checks/optim.py).
Real tokens, batch > 1, a non-uniform, non-contiguous upstream gradient.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from doel.train.checks.base import (
    CheckResult,
    Setup,
    grads_of,
    loss_pass,
    low_precision,
    param_dtype,
    reference_twin,
    rel_err,
)
from doel.train.checks.optim import muon_parity
from doel.train.dist import unwrap
from doel.train.optim import MuonAdamW


def _upstream(shape, device, seed=0) -> torch.Tensor:
    """A non-uniform, non-contiguous upstream gradient (B, T, V): per-position scales spread
    over e^±2, laid out transposed (flash-attention#355 was wrong only for such gradients)."""
    g = torch.Generator().manual_seed(seed)
    b, t, v = shape
    w = torch.randn(v, t, b, generator=g) * torch.exp(2 * torch.randn(1, t, b, generator=g))
    return w.to(device).permute(2, 1, 0)  # (B, T, V), strides of (V, T, B)


def _logits_pass(model, x, grad_out, ctx, backend=None) -> dict[str, torch.Tensor]:
    kernel = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    with kernel, ctx():
        logits = model(x)
    logits.backward(grad_out.to(logits.dtype))
    return {"logits": logits.detach().float(), **grads_of(model)}


def compare(fast: dict, base: dict, ref: dict, factor: float, floor: float) -> dict:
    """The flash-attention rule per tensor: err(fast) <= factor · err(base) + floor, both
    against the float64 reference. Returns the worst tensor by err(fast) / bound."""
    worst = None
    for name, r in ref.items():
        ef, eb = rel_err(fast.get(name), r), rel_err(base.get(name), r)
        bound = factor * eb + floor
        row = {"tensor": name, "fast_err": ef, "eager_err": eb, "bound": bound, "ok": ef <= bound}
        if worst is None or ef / bound > worst["fast_err"] / worst["bound"]:
            worst = row
    return worst or {"tensor": None, "fast_err": 0.0, "eager_err": 0.0, "bound": 0.0, "ok": True}


def _backends(device: torch.device) -> list[SDPBackend]:
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]
    if device.type != "cuda":
        names = names[:1]  # CPU has a flash kernel besides math; the others are CUDA-only
    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


def _try(fn):
    """A backend the device or dtype lacks raises (after warning why): report it as absent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 (torch raises RuntimeError, or a warning as error)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def _sdpa_rows(s: Setup, twin, x, g, base_math, ref64, floor) -> dict:
    """Each attention backend the device has, in the plain model, against the math backend."""
    rows = {}
    for backend in _backends(s.device):
        out = _try(lambda b=backend: _logits_pass(twin, x, g, s.ctx, b))
        name = f"sdpa {backend.name.lower()} vs math"
        if isinstance(out, dict):
            rows[name] = compare(out, base_math, ref64, s.vcfg.parity_factor, floor)
        else:  # the device or dtype lacks this backend
            rows[name] = {"ok": None, "absent": out}
    return rows


def check_parity(s: Setup) -> CheckResult:
    v = s.vcfg
    got = s.batches(-(-v.parity_rows // s.cfg.batch_size))  # enough batches for the rows
    x, y = (torch.cat(t)[: v.parity_rows, : v.parity_max_len] for t in zip(*got))
    eager = unwrap(s.fwd)
    g = _upstream((*x.shape, eager.config.vocab_size), s.device)
    ref = reference_twin(eager, torch.float64)
    ref64 = _logits_pass(ref, x, g.double(), contextlib.nullcontext, SDPBackend.MATH)
    base_twin = reference_twin(eager)
    base_math = _logits_pass(base_twin, x, g, s.ctx, SDPBackend.MATH)
    floor = 8 * torch.finfo(low_precision(s.dtype, param_dtype(eager))).eps
    rows = _sdpa_rows(s, base_twin, x, g, base_math, ref64, floor)
    # The run's own modules (custom or fused kernels) against the plain model, same backend.
    run = _logits_pass(eager, x, g, s.ctx)
    twin = _logits_pass(base_twin, x, g, s.ctx)
    rows["model kernels vs plain model"] = compare(run, twin, ref64, v.parity_factor, floor)
    if s.fwd is not eager:  # compiled (or wrapped): the training call, loss and gradients
        ref_loss = loss_pass(ref, x, y, contextlib.nullcontext, SDPBackend.MATH)
        rows["torch.compile (or wrapper) vs eager"] = compare(
            loss_pass(s.fwd, x, y, s.ctx),
            loss_pass(eager, x, y, s.ctx),
            ref_loss,
            v.parity_factor,
            floor,
        )
    rows.update(adamw_parity(s, run, floor))
    rows.update(muon_parity(s, run, floor, compare))
    bad = [k for k, r in rows.items() if r.get("ok") is False]
    detail = "; ".join(
        f"{k}: {r['tensor']} error {r['fast_err']:.2e} > bound {r['bound']:.2e} "
        f"(eager {r['eager_err']:.2e})"
        for k, r in rows.items()
        if k in bad
    )
    return CheckResult(
        "parity",
        "each fast path (SDPA backends, the model's own kernels, torch.compile, fused AdamW, "
        "Muon) "
        "against a float64 reference, forward and backward: error <= "
        f"{v.parity_factor} x same-dtype eager error + {floor:.1e}; real tokens, "
        f"batch {x.size(0)}, non-uniform non-contiguous upstream gradient",
        not bad,
        rows,
        detail or "every fast path is within the bound",
    )


def _adam_copy(opt: torch.optim.Optimizer, params: dict, plain: bool):
    """An optimizer of opt's class, groups and hyper-parameters over copies `params` (keyed by
    the id of the run's parameter each copies); `plain`: the for-loop implementation."""
    keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    groups = []
    for g in opt.param_groups:
        mine = [params[id(p)] for p in g["params"] if id(p) in params]
        kernel = {"foreach": False, "fused": False} if plain else {}
        if mine:
            groups.append({"params": mine, **{k: g[k] for k in keep if k in g}, **kernel})
    fast = (
        {}
        if plain
        else {"foreach": opt.defaults.get("foreach"), "fused": opt.defaults.get("fused")}
    )
    return type(opt)(groups, **fast)


def adamw_parity(s: Setup, grads: dict, floor: float) -> dict:
    """Two steps of the run's optimizer configuration (fused / foreach) against the for-loop
    implementation, on copies of the run's weights and real gradients."""
    opt = s.optimizer
    if isinstance(opt, MuonAdamW):  # its AdamW part (embedding, head, norms)
        opt = opt.sub("adamw")
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return {"optimizer": {"ok": None, "absent": f"{type(opt).__name__}: no reference"}}
    kind = "fused" if opt.defaults.get("fused") else "foreach/default"
    named = {n: p for n, p in unwrap(s.fwd).named_parameters() if n in grads}
    results = {}
    for label, f64, plain in (("fast", False, False), ("base", False, True), ("ref", True, True)):
        ps = {
            n: p.detach().to(torch.float64 if f64 else p.dtype).clone().requires_grad_()
            for n, p in named.items()
        }
        start = {n: p.detach().clone() for n, p in ps.items()}
        o = _adam_copy(opt, {id(named[n]): p for n, p in ps.items()}, plain)
        for scale in (1.0, -0.5):  # a second, different step exercises the moments
            for n, p in ps.items():
                p.grad = (grads[n] * scale).to(p.dtype)
            o.step()
        results[label] = {n: ps[n].detach() - start[n] for n in ps}
    row = compare(results["fast"], results["base"], results["ref"], s.vcfg.parity_factor, floor)
    return {f"adamw {kind} vs for-loop": row}
