"""The gradient-flow gate: each known failure is planted and must be caught, by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from micro import MODEL
from torch import nn

from doel.train.gradflow import check_gradient_flow
from doel.train.model import Llama


def make_model(tied=True) -> Llama:
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL, tie_word_embeddings=tied)
    return Llama(cfg)


def batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (2, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def offenders(report) -> dict[str, str]:
    return dict(report.offenders)


def test_a_healthy_model_passes_and_keeps_no_gradients():
    model = make_model()
    report = check_gradient_flow(model, batch())
    assert report.ok, report.format()
    assert report.checked == len(list(model.named_parameters(remove_duplicate=False)))
    assert all(p.grad is None for p in model.parameters())


def test_a_detached_branch_is_named():
    model = make_model()
    mlp = model.model.layers[1].mlp
    # The up-projection branch is cut off the graph; gate_proj still learns.
    mlp.forward = lambda x: mlp.down_proj(
        torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x).detach()
    )
    report = check_gradient_flow(model, batch())
    assert not report.ok
    assert "no gradient" in offenders(report)["model.layers.1.mlp.up_proj.weight"]
    assert "model.layers.1.mlp.gate_proj.weight" not in offenders(report)


def test_a_frozen_layer_is_named_unless_allowed():
    model = make_model()
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    report = check_gradient_flow(model, batch())
    assert list(offenders(report)) == ["model.layers.0.self_attn.k_proj.weight"]
    assert "frozen" in report.format()
    assert check_gradient_flow(model, batch(), allow_frozen=True).ok


def test_a_kernel_whose_backward_returns_zeros_is_named():
    model = make_model()
    proj = model.model.layers[0].mlp.down_proj

    class ZeroGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad @ w, torch.zeros_like(w)  # input grad right, weight grad lost

    proj.forward = lambda x: ZeroGrad.apply(x, proj.weight)
    report = check_gradient_flow(model, batch())
    assert offenders(report) == {"model.layers.0.mlp.down_proj.weight": "gradient is all zeros"}


def test_a_nan_is_named():
    model = make_model()
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = float("nan")
    report = check_gradient_flow(model, batch())
    assert not report.ok
    assert any("non-finite" in why for why in offenders(report).values())


def test_a_silently_untied_head_is_caught():
    model = make_model(tied=True)
    # What `to_empty()` or a careless load does: two equal copies, each with a plausible grad.
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    report = check_gradient_flow(model, batch())
    assert "tie was broken" in offenders(report)["lm_head.weight"]


def test_works_on_any_module_with_a_loss_function():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    report = check_gradient_flow(net, (x, y), loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    assert report.ok and report.checked == 4
    with pytest.raises(ValueError, match="scalar"):
        check_gradient_flow(net, (x, y), loss_fn=lambda m, b: m(b[0]))
