"""The verification suite's optimizer checks: the groups (every trainable parameter in exactly
one group; with `optimizer = "muon"`, exactly the hidden matrices in Muon's), and Muon's update
against our own float64 reading of it (the parity check's Muon row). AdamW's parity row is in
parity.py; "one step moves every parameter" (steps.py) covers both optimizers.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from doel.train.checks.base import CheckResult, Setup
from doel.train.dist import unwrap
from doel.train.optim import hidden_matrices

# Keller Jordan's quintic Newton-Schulz coefficients, torch.optim.Muon's default; a run whose
# groups carry others is checked against those.
NS_DEFAULT = (3.4445, -4.7750, 2.0315)


def uses_muon(opt) -> bool:
    return any(g.get("kind") == "muon" for g in getattr(opt, "param_groups", []))


def check_groups(s: Setup) -> CheckResult:
    """Each trainable parameter in exactly one group of the run's optimizer; with Muon, a
    hidden matrix in a Muon group and nothing else there. A matrix left out would train at
    its initial values, one in two groups would take two updates a step."""
    model = unwrap(s.model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    count, kinds = Counter(), defaultdict(set)
    for g in s.optimizer.param_groups:
        for p in g["params"]:
            n = name_of.get(id(p), "(a tensor not in the model)")
            count[n] += 1
            kinds[n].add(g.get("kind", "adamw"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    bad = []
    missing = [n for n in trainable if not count[n]]
    doubled = [n for n, c in count.items() if c > 1]
    if missing:
        bad.append(f"in no group: {_names(missing)}")
    if doubled:
        bad.append(f"in more than one group: {_names(doubled)}")
    if "(a tensor not in the model)" in count:
        bad.append("the optimizer holds tensors that are not the model's parameters")
    muon = uses_muon(s.optimizer)
    if muon:
        hidden = set(hidden_matrices(model))
        off = [n for n in trainable if count[n] == 1 and ("muon" in kinds[n]) != (n in hidden)]
        if off:
            bad.append(f"in the wrong optimizer (Muon takes the hidden matrices): {_names(off)}")
    numbers = {
        "optimizer": "muon" if muon else "adamw",
        "groups": len(s.optimizer.param_groups),
        "trainable": len(trainable),
        "muon_tensors": sum(1 for n in trainable if "muon" in kinds[n]),
        "missing": len(missing),
        "doubled": len(doubled),
    }
    return CheckResult(
        "groups",
        "every trainable parameter is in exactly one optimizer group; with Muon, exactly the "
        "hidden matrices (attention and MLP projections) are in its groups",
        not bad,
        numbers,
        "; ".join(bad) or f"{len(trainable)} tensors, each in one group",
    )


def _names(names: list[str], limit: int = 4) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def newton_schulz(x: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """Muon's orthogonalization as we read it (Keller Jordan's quintic iteration), in x's
    dtype: X / ‖X‖_F, then X ← aX + (bA + cA²)X with A = XXᵀ, on the wide orientation."""
    a, b, c = coefficients
    wide = x.size(0) <= x.size(1)
    y = x if wide else x.T
    y = y / y.norm().clamp_min(eps)
    for _ in range(steps):
        m = y @ y.T
        y = a * y + (b * m + c * (m @ m)) @ y
    return y if wide else y.T


def _adjusted(lr: float, how, shape) -> float:
    rows, cols = shape
    if how in (None, "original"):
        return lr * max(1.0, rows / cols) ** 0.5
    return lr * 0.2 * max(rows, cols) ** 0.5  # match_rms_adamw (Moonshot)


def muon_reference(
    w: torch.Tensor, grads: list[torch.Tensor], group: dict, ns_dtype: torch.dtype
) -> torch.Tensor:
    """The weight after len(grads) Muon steps, elementwise in float64 and Newton-Schulz in
    `ns_dtype` (float64: the reference; bfloat16: the same-precision eager twin)."""
    mu, lr = group["momentum"], float(group["lr"])
    coeffs = tuple(group.get("ns_coefficients", NS_DEFAULT))
    w, buf = w.double(), torch.zeros_like(w, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = mu * buf + (1 - mu) * g
        u = g + mu * (buf - g) if group["nesterov"] else buf
        o = newton_schulz(u.to(ns_dtype), coeffs, group.get("ns_steps", 5), group.get("eps", 1e-7))
        w = w * (1 - lr * group["weight_decay"])
        w = w - _adjusted(lr, group.get("adjust_lr_fn"), w.shape) * o.double()
    return w


def muon_parity(s: Setup, grads: dict, floor: float, compare) -> dict:
    """Two steps of the run's Muon groups (torch's Muon, bf16 Newton-Schulz) on copies of the
    run's hidden matrices with real gradients, against our float64 update; the bound is the
    parity rule with our own bfloat16 twin as the same-precision eager implementation."""
    opt = s.optimizer
    if not uses_muon(opt):
        return {}
    named = {n: p for n, p in unwrap(s.fwd).named_parameters()}
    name_of = {id(p): n for n, p in named.items()}
    fast, base, ref = {}, {}, {}
    for g in opt.param_groups:
        if g.get("kind") != "muon":
            continue
        mine = [name_of[id(p)] for p in g["params"] if name_of.get(id(p)) in grads]
        if not mine:
            continue
        copies = {n: named[n].detach().float().clone().requires_grad_() for n in mine}
        hyper = {k: v for k, v in g.items() if k != "params"}
        step = type(opt)([{**hyper, "params": list(copies.values())}])
        # Two steps, the second's gradient another direction (rows rolled): a scaled copy
        # would orthogonalize to the same matrix and cancel the first step out.
        steps = {n: [grads[n].float(), grads[n].float().roll(1, 0) * -0.5] for n in mine}
        for i in range(2):
            for n, p in copies.items():
                p.grad = steps[n][i].clone()
            step.step()
        for n in mine:
            w0 = named[n].detach().float()
            gs = steps[n]
            fast[n] = copies[n].detach() - w0
            base[n] = muon_reference(w0, gs, g, torch.bfloat16) - w0.double()
            ref[n] = muon_reference(w0, gs, g, torch.float64) - w0.double()
    if not ref:
        return {}
    row = compare(fast, base, ref, s.vcfg.parity_factor, floor)
    return {"muon (torch, bf16 Newton-Schulz) vs float64": row}
