"""The gradient-flow gate: one forward/backward pass, then every trainable parameter must hold a
finite, nonzero gradient, and every declared weight tie must still be one tensor.

It catches what a falling loss curve hides: a branch cut off by `.detach()`, a layer left
frozen, a fused kernel whose backward writes zeros, a NaN, an embedding and head that were
tied once and silently became two copies (each still gets a plausible gradient, so only the
identity check sees it). `doel-train fit` runs it before step 1 and refuses to train on failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from doel.train.dist import unwrap


@dataclass
class GradientReport:
    checked: int  # trainable parameters looked at
    loss: float
    offenders: list[tuple[str, str]] = field(default_factory=list)  # (name, why)
    frozen: list[str] = field(default_factory=list)  # requires_grad=False
    norms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.offenders and math.isfinite(self.loss)

    def format(self) -> str:
        head = f"gradient flow: {self.checked} trainable parameters, loss {self.loss:.4f}: " + (
            "every one has a finite, nonzero gradient" if self.ok else "FAILED"
        )
        lines = [head]
        if not math.isfinite(self.loss):
            lines.append(f"  the loss itself is {self.loss}")
        lines += [f"  {name}: {why}" for name, why in self.offenders]
        if self.frozen and self.ok:
            shown = ", ".join(self.frozen[:5]) + (" …" if len(self.frozen) > 5 else "")
            lines.append(f"  note: {len(self.frozen)} frozen parameters allowed ({shown})")
        return "\n".join(lines)


def step_loss(ctx) -> Callable[[nn.Module, object], torch.Tensor]:
    """The `loss_fn` of the gate on a run's model: the training step's own call (the summed
    loss over the batch's targets, under `ctx`'s autocast), so a compiled graph is reused."""

    def loss_fn(m: nn.Module, batch) -> torch.Tensor:
        with ctx():
            return m(*batch, reduction="sum") / batch[1].numel()

    return loss_fn


def _default_loss(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch)


def check_gradient_flow(
    model: nn.Module,
    batch,
    loss_fn: Callable[[nn.Module, object], torch.Tensor] | None = None,
    ties: list[tuple[str, str]] | None = None,
    allow_frozen: bool = False,
) -> GradientReport:
    """Run `loss_fn(model, batch)` (default: `model(*batch)`, a scalar loss) and backward, then
    judge every trainable parameter. `ties` lists parameter-name pairs that must be the same
    tensor (default: the model's `tied_parameters`, if it declares any). A parameter with
    `requires_grad=False` is an offender too (pre-training trains everything; a forgotten
    freeze is a silent failure) unless `allow_frozen`. Gradients are cleared afterwards, so the
    check leaves no trace on the model."""
    inner = unwrap(model)  # names as the user knows them, not `_orig_mod.` / `module.`
    ties = list(getattr(inner, "tied_parameters", [])) if ties is None else ties
    model.zero_grad(set_to_none=True)
    loss = (loss_fn or _default_loss)(model, batch)
    if loss.dim() != 0:
        raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}")
    loss_value = float(loss.detach())
    if loss.requires_grad:
        loss.backward()
    # remove_duplicate=False: a tied tensor is judged under each of its names.
    named = list(inner.named_parameters(remove_duplicate=False))
    report = GradientReport(checked=0, loss=loss_value)
    for name, p in named:
        if not p.requires_grad:
            report.frozen.append(name)
            if not allow_frozen:
                report.offenders.append((name, "frozen (requires_grad=False)"))
            continue
        report.checked += 1
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # an FSDP shard: judge the whole grad
            g = g.full_tensor()
        if g is None:
            report.offenders.append((name, "no gradient (None): not on the loss's graph"))
        elif not torch.isfinite(g).all():
            bad = int((~torch.isfinite(g)).sum())
            report.offenders.append((name, f"non-finite gradient ({bad} of {g.numel()} NaN/inf)"))
        elif not g.any():
            report.offenders.append((name, "gradient is all zeros"))
        else:
            report.norms[name] = float(g.float().norm())
    params = dict(named)
    for a, b in ties:
        if a not in params or b not in params:
            report.offenders.append((f"{a} / {b}", "declared tied, but a name is missing"))
        elif params[a] is not params[b] and params[a].data_ptr() != params[b].data_ptr():
            report.offenders.append(
                (b, f"should be tied to {a} but is a separate tensor (the tie was broken)")
            )
    model.zero_grad(set_to_none=True)
    return report
