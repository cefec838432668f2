"""The tied-weights check: after every wrap (compile, DDP, FSDP) the embedding and the head are
one tensor, and its gradient holds both uses' contributions.

On one process each use's contribution is measured by running the same model with the tie
split (each use its own copy). Under DDP or FSDP the parameters belong to the wrapper (FSDP
swaps them between shards and whole tensors), so they cannot be split there; instead, hooks on
the modules that use the tied tensor rebuild each use's weight gradient from its input and its
output's gradient during the wrapper's own backward (an embedding's rows gather its output
gradients, a linear layer's is gᵀx), averaged over ranks as the wrapper averages; the wrapper's
gradient (whole, under FSDP) must equal their sum. This runs in `fit` before step 1 under
torchrun. The extra memory is two vocabulary × hidden float32 matrices, once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from doel.train.checks.base import (
    CheckResult,
    Setup,
    loss_pass,
    low_precision,
    param_dtype,
    rel_err,
    strip_prefix,
)
from doel.train.dist import unwrap

CHECKED = (
    "declared ties are one tensor through every wrapper (compile, DDP, FSDP) and the shared "
    "gradient equals the sum of both uses' gradients"
)


@contextlib.contextmanager
def _untied(model: nn.Module, names: list[str]):
    """Temporarily give each named parameter its own copy (so its gradient holds only its own
    use's contribution); the original tensor is put back whatever happens."""
    saved = []
    try:
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            original = getattr(owner, attr)
            saved.append((owner, attr, original))
            copy = nn.Parameter(original.detach().clone(), original.requires_grad)
            setattr(owner, attr, copy)
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _broken(module: nn.Module, pairs) -> list[str]:
    params = {strip_prefix(n): p for n, p in module.named_parameters(remove_duplicate=False)}
    return [
        f"{b} is a separate tensor from {a} (the tie was broken)"
        for a, b in pairs
        if a not in params or b not in params or params[a] is not params[b]
    ]


def check_ties(s: Setup) -> CheckResult:
    pairs = list(getattr(unwrap(s.fwd), "tied_parameters", []))
    if not pairs:
        return CheckResult("ties", CHECKED, None, {}, "the model declares no tied parameters")
    broken = _broken(s.fwd, pairs)
    if broken:
        return CheckResult("ties", CHECKED, False, {"pairs": len(pairs)}, "; ".join(broken))
    inner = unwrap(s.fwd)
    tol = max(1e-4, 8 * torch.finfo(low_precision(s.dtype, param_dtype(inner))).eps)
    x, y = s.batch()
    if _world_size() > 1:  # under the wrapper: each use's gradient rebuilt by hooks
        wrapper = getattr(s.fwd, "_orig_mod", s.fwd)  # eager: hooks under compile recompile
        shared, parts = _hooked_pass(wrapper, pairs, x, y, s.ctx)
        broken = _broken(wrapper, pairs)  # FSDP re-registers parameters around a backward
        if broken:
            return CheckResult("ties", CHECKED, False, {"pairs": len(pairs)}, "; ".join(broken))
    else:
        shared = loss_pass(s.fwd, x, y, s.ctx)
        with _untied(inner, [b for _, b in pairs]):  # the same model, each use with its own copy
            parts = loss_pass(inner, x, y, s.ctx)
    numbers, bad = {"pairs": len(pairs), "tolerance": tol, "ranks": _world_size()}, []
    for a, b in pairs:
        if parts.get(a) is None or parts.get(b) is None:
            bad.append(f"{a}: a use of the tied tensor got no gradient of its own")
            continue
        whole = parts[a].double() + parts[b].double()
        err = rel_err(shared.get(a), whole)
        numbers[a] = {
            "error_vs_sum": err,
            "input_side_share": float(parts[a].norm() / whole.norm()),
            "output_side_share": float(parts[b].norm() / whole.norm()),
        }
        if err > tol:
            bad.append(f"{a}: the shared gradient is {err:.1%} off the sum of both uses")
    return CheckResult("ties", CHECKED, not bad, numbers, "; ".join(bad) or "ties hold")


def _use_gradient(module: nn.Module, inp: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The weight gradient of one call of `module` (an Embedding or a Linear layer), from its
    input and its output's gradient, in float32."""
    g = g.detach().float().reshape(-1, g.shape[-1])
    if isinstance(module, nn.Embedding):
        rows = torch.zeros(module.num_embeddings, module.embedding_dim, device=g.device)
        rows.index_add_(0, inp.reshape(-1), g)
        if module.padding_idx is not None:
            rows[module.padding_idx] = 0
        return rows
    if isinstance(module, nn.Linear):
        return g.T @ inp.detach().float().reshape(-1, inp.shape[-1])
    raise TypeError(f"a tied weight used by {type(module).__name__}: only Embedding and Linear")


def _hooked_pass(wrapper: nn.Module, pairs, x, y, ctx) -> tuple[dict, dict]:
    """One loss pass through the wrapper: its (rank-averaged, whole) gradient of each tied
    tensor, and each use's own gradient rebuilt by hooks and averaged over ranks."""
    inner = unwrap(wrapper)
    parts: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name):
        def forward_hook(module, args, out):
            def grad_hook(g):  # summed over calls: a module may run more than once
                part = _use_gradient(module, args[0], g)
                parts[name] = part if name not in parts else parts[name] + part

            out.register_hook(grad_hook)

        return forward_hook

    for name in {n for pair in pairs for n in pair}:
        owner = inner.get_submodule(name.rpartition(".")[0])
        handles.append(owner.register_forward_hook(hook(name)))
    try:
        wrapper.zero_grad(set_to_none=True)
        with ctx():
            loss = wrapper(x, y, reduction="sum") / y.numel()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    params = dict(inner.named_parameters(remove_duplicate=False))
    shared = {}
    for a, _ in pairs:
        g = params[a].grad
        shared[a] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g)
        shared[a] = None if shared[a] is None else shared[a].detach().clone()
    wrapper.zero_grad(set_to_none=True)
    if dist.is_initialized():  # DDP and FSDP average the gradients over ranks: so do we
        for name in sorted(parts):  # the same order on every rank
            dist.all_reduce(parts[name])
            parts[name] /= dist.get_world_size()
    return shared, parts
