"""One step of training (doel.train.step): the schedule, token-normalised gradient accumulation,
one update and one ramped step; the optimizer's groups and the config's validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from micro import MODEL, train_config

from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.model import Llama, ModelConfig
from doel.train.optim import MuonAdamW, build_optimizer, describe_groups
from doel.train.settings import TrainConfig
from doel.train.step import (
    lr_at,
    micro_batches_per_update,
    take_step,
    train_step,
    updates_before,
)

cfg = train_config


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_lr_schedule_shape(schedule):
    c = cfg(schedule=schedule, lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, decay_fraction=0.3)
    lrs = [lr_at(s, c) for s in range(c.steps)]
    assert all(0 < a < b for a, b in zip(lrs[:9], lrs[1:10]))  # warmup rises
    assert lrs[9] == pytest.approx(1e-3)  # and reaches the peak
    assert max(lrs) == pytest.approx(1e-3)
    after = lrs[10:]
    assert all(b <= a + 1e-15 for a, b in zip(after, after[1:]))  # never rises again
    if schedule == "constant":
        assert lrs[-1] == pytest.approx(1e-3)
    else:
        assert lrs[-1] == pytest.approx(1e-4)  # ends at lr * min_lr_ratio
    if schedule == "wsd":
        assert lrs[69] == pytest.approx(1e-3) and lrs[71] < 1e-3  # decays over the last 30%


def grads_after(micro_batches):
    torch.manual_seed(0)
    model = Llama(MODEL)
    n = sum(int((y != -100).sum()) for _, y in micro_batches)
    for x, y in micro_batches:
        (model(x, y, reduction="sum") / n).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_accumulating_k_micro_batches_equals_one_k_times_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (6, 16), generator=g)
    y = torch.randint(0, 64, (6, 16), generator=g)
    y[0, :10] = -100  # uneven token counts per micro-batch: a mean of means would be wrong
    y[4, 3:] = -100
    whole = grads_after([(x, y)])
    split = grads_after([(x[i : i + 2], y[i : i + 2]) for i in (0, 2, 4)])
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)
    # ...and the naive mean of per-micro-batch means really differs here (the test can fail).
    torch.manual_seed(0)
    model = Llama(MODEL)
    for i in (0, 2, 4):
        (model(x[i : i + 2], y[i : i + 2]) / 3).backward()
    naive = model.lm_head.weight.grad
    assert not torch.allclose(naive, whole["lm_head.weight"], rtol=1e-3, atol=1e-6)


def test_train_step_reports_the_token_mean_and_learns():
    torch.manual_seed(0)
    c = cfg(lr=1e-2)
    model = Llama(MODEL)
    opt = build_optimizer(model, c, torch.device("cpu"))
    x = torch.randint(0, 64, (4, 16))
    y = torch.roll(x, -1, 1)
    with torch.no_grad():
        expected = float(model(x, y))
    first = train_step(model, opt, [(x[:2], y[:2]), (x[2:], y[2:])], lr=1e-2)
    assert float(first["loss"]) == pytest.approx(expected, rel=1e-5)
    assert first["tokens"] == 64 and math.isfinite(float(first["grad_norm"]))
    for _ in range(30):
        last = train_step(model, opt, [(x, y)], lr=1e-2)
    assert float(last["loss"]) < 0.5 * expected
    assert all(p.grad is None for p in model.parameters())


def test_a_batch_ramp_makes_smaller_updates_early_and_keeps_every_step_whole():
    c = cfg(grad_accum=4, batch_ramp_fraction=0.3)  # 100 steps: the ramp is steps 0-29
    per = [micro_batches_per_update(s, c) for s in range(c.steps)]
    assert all(4 % p == 0 for p in per)  # a step holds whole updates of its 4 micro-batches
    assert per[:10] == [1] * 10 and per[10:30] == [2] * 20 and per[30:] == [4] * 70
    assert updates_before(c.steps, c) == sum(4 // p for p in per) == 40 + 40 + 70
    assert [updates_before(s, c) for s in (0, 1, 10, 31)] == [0, 4, 40, 81]
    plain = cfg(grad_accum=4)
    assert {micro_batches_per_update(s, plain) for s in range(100)} == {4}
    assert updates_before(100, plain) == 100


def test_take_step_updates_once_per_group_of_micro_batches():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 16))
    y = torch.roll(x, -1, 1)
    y[0, :10] = -100  # uneven target counts: the step's loss is the mean over all its tokens
    micro = [(x[:2], y[:2]), (x[2:], y[2:])]
    a = Llama(MODEL)
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    opts = [build_optimizer(m, cfg(optimizer="muon"), torch.device("cpu")) for m in (a, b, c)]
    ramped = take_step(a, opts[0], micro, 1, lr=1e-2)
    one = train_step(b, opts[1], micro[:1], lr=1e-2)
    two = train_step(b, opts[1], micro[1:], lr=1e-2)
    assert ramped["updates"] == 2 and int(ramped["tokens"]) == 64 - 10
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    mean = (float(one["loss"]) * 22 + float(two["loss"]) * 32) / 54
    assert float(ramped["loss"]) == pytest.approx(mean, rel=1e-6)
    assert torch.equal(ramped["grad_norm"], two["grad_norm"])
    whole = take_step(c, opts[2], micro, 2, lr=1e-2)  # no ramp: exactly train_step
    assert whole["updates"] == 1 and float(whole["loss"]) != float(ramped["loss"])
    assert not torch.equal(c.lm_head.weight, a.lm_head.weight)


def test_weight_decay_skips_norms():
    model = Llama(MODEL)
    opt = build_optimizer(model, cfg(weight_decay=0.1), torch.device("cpu"))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in plain["params"]) and len(plain["params"]) == 5


@pytest.mark.parametrize(
    "override, field",
    [
        ("seq_len=0", "seq_len"),
        ("schedule=linear", "schedule"),
        ("dtype=float16", "dtype"),
        ("min_lr_ratio=2", "min_lr_ratio"),
        ("seq_len=4096", "max_position_embeddings"),
        ("optimizer=sgd", "optimizer"),
        ("muon_lr=0", "muon_lr"),
        ("muon_momentum=1", "muon_momentum"),
        ("muon_adjust_lr=rms", "muon_adjust_lr"),
        ("batch_ramp_fraction=1", "batch_ramp_fraction"),
        ("batch_ramp_fraction=0.2", "batch_ramp_fraction"),  # grad_accum=1: nothing to ramp
    ],
)
def test_bad_train_config_names_the_field(override, field):
    with pytest.raises(DoelError, match=field):
        load_config(TrainConfig, None, [override])


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    model = Llama(ModelConfig(**{**MODEL.__dict__, "tie_word_embeddings": tied}))
    opt = build_optimizer(model, cfg(optimizer="muon", lr=1e-3, muon_lr=0.02), torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    name = {id(p): n for n, p in model.named_parameters()}
    kinds = {name[id(p)]: g["kind"] for g in opt.param_groups for p in g["params"]}
    assert sorted(kinds) == sorted(name.values())  # every parameter in exactly one group
    muon = {n for n, k in kinds.items() if k == "muon"}
    assert muon == {n for n in name.values() if n.endswith("proj.weight")}  # 7 a block
    assert len(muon) == 7 * MODEL.num_hidden_layers
    assert kinds["model.embed_tokens.weight"] == "adamw"
    assert tied or kinds["lm_head.weight"] == "adamw"
    lines = describe_groups(opt, model)
    assert lines[0].startswith("optimizer group muon: 14 tensors") and "lr 2.00e-02" in lines[0]
    # The schedule drives both rates: Muon's stays muon_lr / lr times AdamW's.
    train_step(model, opt, [(torch.randint(0, 64, (2, 16)),) * 2], lr=5e-4)
    lrs = {g["kind"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"muon": pytest.approx(1e-2), "adamw": pytest.approx(5e-4)}


def _newton_schulz64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Our float64 reading of Muon's orthogonalization (Keller Jordan's quintic, coefficients
    3.4445, -4.7750, 2.0315), to check torch's bf16 one against."""
    a, b, c = 3.4445, -4.7750, 2.0315
    wide = x.size(0) <= x.size(1)
    y = (x if wide else x.T) / x.norm()
    for _ in range(steps):
        m = y @ y.T
        y = a * y + (b * m + c * m @ m) @ y
    return y if wide else y.T


def test_a_muon_step_matches_a_float64_reference_of_the_update():
    g = torch.Generator().manual_seed(3)
    w0 = {s: torch.randn(*s, generator=g) * 0.1 for s in ((48, 16), (16, 48))}
    grads = [{s: torch.randn(*s, generator=g) for s in w0} for _ in range(2)]
    ps = {s: torch.nn.Parameter(w.clone()) for s, w in w0.items()}
    group = {"kind": "muon", "lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True}
    opt = MuonAdamW([{**group, "params": list(ps.values())}])
    ref = {s: w.double() for s, w in w0.items()}
    buf = {s: torch.zeros_like(r) for s, r in ref.items()}
    for step in grads:
        for s, p in ps.items():
            p.grad = step[s].clone()
            gd = step[s].double()
            buf[s] = 0.9 * buf[s] + 0.1 * gd
            u = gd + 0.9 * (buf[s] - gd)  # Nesterov
            scale = max(1, s[0] / s[1]) ** 0.5  # "original": sqrt(max(1, rows/cols))
            ref[s] = ref[s] * (1 - 0.02 * 0.1) - 0.02 * scale * _newton_schulz64(u)
        opt.step()
    for s, p in ps.items():
        moved, want = p.detach().double() - w0[s].double(), ref[s] - w0[s].double()
        # bf16 Newton-Schulz: a few bf16 epsilons (2^-8) of the update, not a wrong formula
        assert float((moved - want).norm() / want.norm()) < 0.03, s
