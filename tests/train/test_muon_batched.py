"""Muon batched by shape (issue 56, item 4): one Newton-Schulz over each shape's stack instead of
one a matrix. It must be torch.optim.Muon's update: the batched iteration against torch's own
per-matrix one, and MuonAdamW's steps against torch.optim.Muon's on the same gradients."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from doel.train.model import Llama
from doel.train.optim import MuonAdamW, hidden_matrices, newton_schulz_batched

NS = (3.4445, -4.7750, 2.0315)


@pytest.mark.parametrize(
    "shape, coefficients",
    [((64, 64), NS), ((176, 64), NS), ((64, 176), NS), ((32, 64), NS), ((64, 176), (1.0, 0, 0))],
)
def test_batched_newton_schulz_equals_the_per_matrix_one(shape, coefficients):
    """(1, 0, 0), the identity polynomial (the suite's planted broken Muon), included."""
    g = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([_zeropower_via_newtonschulz(m, coefficients, 5, 1e-7) for m in g])
    got = newton_schulz_batched(g, coefficients, 5, 1e-7)
    assert torch.isfinite(got).all()
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    # bit for bit on the CPU; a GPU's batched matmul may sum in another order
    assert torch.equal(got, ref) or float((got - ref).float().norm() / ref.float().norm()) < 1e-2


def test_muonadamw_steps_like_torch_muon(tiny_model_config):
    torch.manual_seed(0)
    a = Llama(tiny_model_config)
    b = Llama(tiny_model_config)
    b.load_state_dict(a.state_dict())
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=None)

    def hidden(m):
        names = set(hidden_matrices(m))
        return [p for n, p in m.named_parameters() if n in names]

    assert len({tuple(p.shape) for p in hidden(a)}) < len(hidden(a))  # shapes repeat: batched
    ours = MuonAdamW([{"kind": "muon", "params": hidden(a), **hyper}])
    theirs = torch.optim.Muon(hidden(b), **hyper)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # momentum and Nesterov across steps
        for pa, pb in zip(hidden(a), hidden(b)):
            pa.grad = torch.randn(pa.shape, generator=gen)
            pb.grad = pa.grad.clone()
        ours.step()
        theirs.step()
    for pa, pb in zip(hidden(a), hidden(b)):
        assert torch.equal(pa, pb)
        assert torch.equal(ours.state[pa]["momentum_buffer"], theirs.state[pb]["momentum_buffer"])
