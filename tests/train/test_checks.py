"""The verification suite proves itself: each silent-failure class is planted in the tiny preset
and the suite must flag exactly the check that owns it (plus, where named, the checks that the
same defect honestly breaks too), while a short training run of the same broken setup still
shows a falling loss: the loss curve alone does not reveal any of them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from doel.train.build import build_parts
from doel.train.checks.base import VerifyConfig
from doel.train.checks.suite import CHECKS, VerificationError, run_suite, verify_before_training
from doel.train.data.loader import TokenLoader
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.textio import resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
from doel.train.model import IGNORE_INDEX, Llama
from doel.train.optim import MuonAdamW, build_optimizer
from doel.train.step import lr_at, train_step

pytestmark = pytest.mark.slow  # every test here runs the suite or trains (seconds to minutes)
ALL = list(CHECKS)


def failed(report) -> set[str]:
    return set(report.failed)


def suite(cfg, shards, checks=None, optimizer_factory=None, **kw):
    """The full suite on `cfg`; a planted optimizer_factory(model, cfg) gets the run's config."""
    if optimizer_factory:
        kw["optimizer_factory"] = lambda model: optimizer_factory(model, cfg)
    return run_suite(cfg, shards, "full", checks=checks, log=lambda s: None, **kw)


def loss_curve(
    cfg, shards, model_factory=None, optimizer_factory=None, loader=None, steps=12, resume_at=None
) -> list[float]:
    """The broken setup trained the normal way: train_step, the run's schedule, real batches.
    With `resume_at`, the loader is saved and restored there, as a resumed run would."""
    torch.manual_seed(0)
    model = (model_factory or (lambda c: Llama(c.model)))(cfg)
    build = optimizer_factory or (lambda m, c: build_optimizer(m, c, torch.device("cpu")))
    opt = build(model, cfg)
    loader = loader or TokenLoader(shards, "train", cfg.batch_size, cfg.seq_len, cfg.seed)
    losses = []
    for step in range(steps):
        if step == resume_at:
            loader.load_state_dict(loader.state_dict())
        x, y = (torch.from_numpy(a) for a in loader.next_batch())
        losses.append(float(train_step(model, opt, [(x, y)], lr_at(step, cfg), 1.0)["loss"]))
    return losses


def assert_falls(losses: list[float]) -> None:
    head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert tail < 0.97 * head, f"the loss should still fall: {losses}"


# ---------------------------------------------------------------- the healthy preset


def test_healthy_tiny_config_passes_every_check_and_writes_the_report(
    shards, tmp_path, tiny_config
):
    report = run_suite(tiny_config(), shards, "full", out_dir=tmp_path, log=lambda s: None)
    assert [r.name for r in report.results] == ALL
    assert all(r.passed is True for r in report.results), report.format()
    data = json.loads((tmp_path / "verify.json").read_text())
    assert data["ok"] and [c["status"] for c in data["checks"]] == ["pass"] * len(ALL)
    assert data["checks"][0]["numbers"]["parameters"] == 21
    md = (tmp_path / "verify.md").read_text()
    assert md.count("| **pass** |") == len(ALL) and "| check | status |" in md


def eager_parts(cfg, shards):
    """The Run `fit` builds (train/build.py), eager, on the CPU: what verify_before_training
    checks."""
    return build_parts(cfg, shards, device=torch.device("cpu"), compile=False, log=lambda s: None)


def test_fast_subset_runs_before_training_and_leaves_no_trace(shards, tiny_config):
    parts = eager_parts(tiny_config(), shards)
    model, opt, loader = parts.model, parts.optimizer, parts.loader
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    lines = []
    report = verify_before_training(parts, lines.append)
    assert report.ok and "resume" not in [r.name for r in report.results]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert loader.state_dict()["cursor"] == 0 and not opt.state
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert any("verification (fast" in line for line in lines)


def test_before_training_refuses_a_run_whose_optimizer_misses_a_parameter(shards, tiny_config):
    parts = eager_parts(tiny_config(), shards)
    opt = parts.optimizer
    opt.param_groups[1]["params"] = opt.param_groups[1]["params"][1:]  # a norm left out
    with pytest.raises(VerificationError, match="step"):
        verify_before_training(parts, lambda s: None)


# ---------------------------------------------------------------- planted kernels


class ZeroWeightGrad(torch.autograd.Function):
    """x @ w.T whose backward returns zeros for w (a fused kernel that forgot to write it)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, torch.zeros_like(w)


class WrongWeightGrad(torch.autograd.Function):
    """x @ w.T whose weight gradient pairs the wrong features: finite, the right size, wrong."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.flatten(0, -2).t() @ x.flip(-1).flatten(0, -2)


class SlowBackward(torch.autograd.Function):
    """x @ w.T with a correct backward that redoes its weight-gradient matmul 40 times."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.flatten(0, -2), x.flatten(0, -2)
        for _ in range(40):
            gw = g2.t() @ x2
        return g @ w, gw


def with_kernel(fn, where=lambda m: m.model.layers[0].mlp.down_proj):
    def factory(cfg):
        model = Llama(cfg.model)
        lin = where(model)
        lin.forward = lambda x: fn.apply(x, lin.weight)
        return model

    return factory


@pytest.mark.parametrize(
    "kernel, expected",
    [
        # gradient_flow owns "all zeros"; parity sees the same kernel differ from the reference.
        (ZeroWeightGrad, {"gradient_flow", "parity"}),
        # Finite and nonzero: only the float64 reference catches it.
        (WrongWeightGrad, {"parity"}),
    ],
)
def test_a_kernel_with_a_broken_backward(shards, tiny_config, kernel, expected):
    cfg, factory = tiny_config(), with_kernel(kernel)
    report = suite(cfg, shards, model_factory=factory)
    assert failed(report) == expected, report.format()
    row = {r.name: r for r in report.results}["parity"]
    assert "model kernels vs plain model" in row.detail and "down_proj" in row.detail
    assert_falls(loss_curve(cfg, shards, factory))


def test_a_slow_backward_fails_the_throughput_floor(shards, tiny_config):
    cfg, factory = tiny_config(), with_kernel(SlowBackward, lambda m: m.lm_head)
    report = suite(cfg, shards, model_factory=factory)
    assert failed(report) == {"throughput"}, report.format()
    numbers = {r.name: r for r in report.results}["throughput"].numbers
    assert numbers["backward_over_forward"] > 5
    assert_falls(loss_curve(cfg, shards, factory))


# ---------------------------------------------------------------- planted model and optimizer


def frozen_layer(cfg):
    model = Llama(cfg.model)
    model.model.layers[1].self_attn.requires_grad_(False)
    return model


def untied_head(cfg):
    model = Llama(cfg.model)  # the config still declares the tie
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    return model


class DoubleShift(Llama):
    """Shifts the (already shifted) targets once more: position t learns token t + 2."""

    def forward(self, idx, targets=None, reduction="mean"):
        if targets is not None:
            pad = torch.full_like(targets[:, :1], IGNORE_INDEX)
            targets = torch.cat([targets[:, 1:], pad], dim=1)
        return super().forward(idx, targets, reduction)


def leaky(cfg):
    """Layer 0 attends without the causal mask: every position sees the whole row."""
    model = Llama(cfg.model)
    attn = model.model.layers[0].self_attn

    def forward(x, cos, sin):
        from doel.train.model import apply_rotary

        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, attn.n_head, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, attn.n_kv, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.n_kv, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
        return attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    attn.forward = forward
    return model


class MeanPerMicroBatch(Llama):
    """Ignores reduction='sum' and returns each micro-batch's mean (transformers PR #34191)."""

    def forward(self, idx, targets=None, reduction="mean"):
        return super().forward(idx, targets, "mean" if targets is not None else reduction)


def bf16_weights(cfg):
    return Llama(cfg.model).to(torch.bfloat16)  # no float32 master copy


def leaves_out(name):
    def factory(model, cfg):
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        p = dict(model.named_parameters())[name]
        for group in opt.param_groups:
            group["params"] = [q for q in group["params"] if q is not p]
        return opt

    return factory


@pytest.mark.parametrize(
    "plant, expected, says",
    [
        (
            {"model_factory": frozen_layer},
            {"gradient_flow"},
            "layers.1.self_attn.q_proj.weight: frozen",
        ),
        # (train_step clears the model's gradients, not only the optimizer's, so the orphan
        # cannot swell the clipping norm: resume holds; the groups check names it before any
        # step, the step check sees it stay put.)
        (
            {"optimizer_factory": leaves_out("model.layers.1.mlp.up_proj.weight")},
            {"groups", "step"},
            "unchanged after one step: model.layers.1.mlp.up_proj.weight (not in the optimizer",
        ),
        # A checkpoint stores a declared-tied head once, so resuming also loses the lone head.
        ({"model_factory": untied_head}, {"ties", "resume"}, "lm_head.weight is a separate tensor"),
        # The float64 reference is causal, so parity sees the unmasked layer differ from it.
        ({"model_factory": leaky}, {"causal", "parity"}, "future-token leak"),
        ({"model_factory": lambda c: DoubleShift(c.model)}, {"causal"}, "shifts them again"),
        ({"model_factory": lambda c: MeanPerMicroBatch(c.model)}, {"accumulation"}, "averaged"),
        # (bf16 matmuls on a CPU without AMX may also make the backward slow: a CPU's trait.)
        ({"model_factory": bf16_weights}, {"step"}, "rounds away in bfloat16"),
    ],
    ids=["frozen", "not-in-optimizer", "untied", "leak", "double-shift", "mean-loss", "bf16"],
)
def test_a_planted_model_or_optimizer_failure_is_flagged_where_it_belongs(
    shards, tiny_config, plant, expected, says
):
    cfg = tiny_config()
    report = suite(cfg, shards, **plant)
    noise = {"throughput"} if plant.get("model_factory") is bf16_weights else set()
    assert failed(report) - noise == expected, report.format()
    assert says in " ".join(r.detail for r in report.results if r.passed is False)
    assert_falls(
        loss_curve(cfg, shards, plant.get("model_factory"), plant.get("optimizer_factory"))
    )
    numbers = {r.name: r.numbers for r in report.results}
    if plant.get("model_factory") is leaky:
        assert numbers["causal"]["leak"] > 1e-3
    if says == "shifts them again":
        assert numbers["causal"]["copied_loss"] > 1.0  # the double shift cannot learn copies


# ---------------------------------------------------------------- planted data and tokenizer


class RestartsOnResume(TokenLoader):
    """Restores the epoch but not the cursor: a resumed run replays the epoch from its start."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.cursor = 0


class SameWindows(TokenLoader):
    """Serves the first batch over and over."""

    def next_batch(self):
        self.cursor = 0
        return super().next_batch()


class TargetsAreInputs(TokenLoader):
    """Forgets the shift: each position is asked for its own token."""

    def next_batch(self):
        x, _ = super().next_batch()
        return x, x.copy()


def test_a_loader_without_the_shift_fails_the_causal_check(shards, tiny_config):
    cfg = tiny_config()

    def make():
        return TargetsAreInputs(shards, "train", cfg.batch_size, cfg.seq_len, cfg.seed)

    row = suite(cfg, shards, ["causal"], loader_factory=make).results[0]
    assert row.passed is False and not row.numbers["loader_targets_shifted_by_one"]
    assert_falls(loss_curve(cfg, shards, loader=make()))


def test_a_loader_that_repeats_data_after_resume_fails_resume_only(shards, tiny_config):
    cfg = tiny_config()

    def make():
        return RestartsOnResume(shards, "train", cfg.batch_size, cfg.seq_len, cfg.seed)

    report = suite(cfg, shards, loader_factory=make)
    assert failed(report) == {"resume"}, report.format()
    assert "different batches from step 3" in report.results[ALL.index("resume")].detail
    assert_falls(loss_curve(cfg, shards, loader=make(), resume_at=6))


def test_repeated_windows_and_validation_overlap_fail_the_data_check(shards, tmp_path, tiny_config):
    cfg = tiny_config()
    same = suite(
        cfg,
        shards,
        ["data", "resume"],
        loader_factory=lambda: SameWindows(shards, "train", cfg.batch_size, cfg.seq_len, cfg.seed),
    )
    assert failed(same) == {"data"} and "repeat an earlier one" in same.results[0].detail
    leaked = tmp_path / "leaked"
    shutil.copytree(shards, leaked)
    meta = json.loads((leaked / "meta.json").read_text())
    meta["overlap"] |= {"share": 0.04, "exact_duplicates_of_validation_in_train": 2}
    (leaked / "meta.json").write_text(json.dumps(meta))
    report = suite(cfg, leaked, ["data"])
    assert failed(report) == {"data"} and "4.00% of validation" in report.results[0].detail


def test_a_gpt2_style_tokenizer_on_bangla_fails_the_tokenizer_check(
    tmp_path, sample_paths, tiny_config
):
    tok_cfg = TokenizerConfig(vocab_size=2048, min_frequency=1, style="gpt2")
    tok = train_tokenizer(resolve_sources(sample_paths), tok_cfg, tmp_path / "tok", progress=False)
    data = tmp_path / "shards"
    prepare(tok, sample_paths, data, PrepareConfig(val_fraction=0.1), progress=False)
    cfg = tiny_config()
    report = suite(cfg, data, ["data", "tokenizer"])
    assert failed(report) == {"tokenizer"}, report.format()
    numbers = report.results[1].numbers
    assert numbers["bengali"]["chars_per_token"] < 0.5 * numbers["latin"]["chars_per_token"]
    assert_falls(loss_curve(cfg, data))


def test_verify_config_and_subsets_are_validated(shards, tiny_config):
    with pytest.raises(ValueError, match="resume_steps"):
        VerifyConfig(resume_steps=3)
    with pytest.raises(Exception, match="unknown checks"):
        suite(tiny_config(), shards, ["nonsense"])


def test_the_command_writes_the_report_and_exits_1_on_a_failure(shards, tmp_path, capsys):
    from doel.train.cli import main

    args = ["verify", "--config", "tiny", "--data", str(shards), "--out", str(tmp_path)]
    main([*args, "--only", "data", "tokenizer"])
    assert json.loads((tmp_path / "verify.json").read_text())["ok"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--only", "throughput", "--check", "max_backward_ratio=0.01"])
    assert exit_.value.code == 1
    assert "FAIL throughput" in capsys.readouterr().out
    assert json.loads((tmp_path / "verify.json").read_text())["checks"][0]["status"] == "FAIL"


def head_sees_a_detached_weight(cfg):
    """The tie holds (one tensor), but the head's use is cut off the graph: the shared
    gradient holds the embedding's contribution alone."""
    model = Llama(cfg.model)
    head = model.lm_head
    head.forward = lambda h: F.linear(h, head.weight.detach())
    return model


@pytest.mark.parametrize("ranks", [1, 2])
def test_ties_need_one_tensor_holding_both_uses_gradients(shards, tiny_config, monkeypatch, ranks):
    """At 2 ranks (simulated: no process group) the check takes its DDP/FSDP path, where each
    use's gradient is rebuilt by hooks instead of by splitting the tie."""
    import doel.train.checks.ties

    monkeypatch.setattr(doel.train.checks.ties, "_world_size", lambda: ranks)
    cfg = tiny_config()
    row = suite(cfg, shards, ["ties"]).results[0]
    assert row.passed, row.detail
    parts = row.numbers["model.embed_tokens.weight"]
    assert parts["error_vs_sum"] < 1e-5
    assert parts["input_side_share"] > 0.01 and parts["output_side_share"] > 0.01
    untied = suite(cfg, shards, ["ties"], model_factory=untied_head).results[0]
    assert untied.passed is False and "tie was broken" in untied.detail
    cut = suite(cfg, shards, ["ties"], model_factory=head_sees_a_detached_weight).results[0]
    assert cut.passed is False and "model.embed_tokens.weight" in cut.detail


# ---------------------------------------------------------------- Muon


class UnorthogonalizedMuon(MuonAdamW):
    """Muon that forgot to orthogonalize: its Newton-Schulz polynomial is the identity, so the
    update is the momentum scaled to unit norm (a descent direction, just not Muon's)."""

    def step(self, closure=None):
        saved = [(g, g["ns_coefficients"]) for g in self.param_groups if g["kind"] == "muon"]
        for g, _ in saved:
            g["ns_coefficients"] = (1.0, 0.0, 0.0)
        try:
            return super().step(closure)
        finally:
            for g, c in saved:
                g["ns_coefficients"] = c


def test_muon_passes_the_groups_parity_and_step_checks_and_a_broken_muon_fails_parity(
    shards, tiny_config
):
    cfg = tiny_config("optimizer=muon")
    report = suite(cfg, shards, ["groups", "parity", "step"])
    assert report.ok, report.format()
    rows = {r.name: r for r in report.results}
    assert rows["groups"].numbers["muon_tensors"] == 7 * cfg.model.num_hidden_layers
    row = rows["parity"].numbers["muon (torch, bf16 Newton-Schulz) vs float64"]
    # bf16 Newton-Schulz is far from float64 on real (ill-conditioned) gradients, but no
    # farther than our own bf16 twin of the same update: the parity rule's bound
    assert row["ok"] and row["fast_err"] <= row["bound"]

    def broken(model, c):
        return UnorthogonalizedMuon(build_optimizer(model, c, torch.device("cpu")).param_groups)

    bad = suite(cfg, shards, ["parity"], optimizer_factory=broken)
    assert failed(bad) == {"parity"}
    assert "muon" in bad.results[0].detail, bad.results[0].detail
    worse = bad.results[0].numbers["muon (torch, bf16 Newton-Schulz) vs float64"]
    assert worse["fast_err"] > 3 * row["fast_err"]


@pytest.mark.parametrize("plant", ["in no group", "in more than one group"])
def test_a_hidden_matrix_in_no_group_or_in_both_is_caught_before_step_1(shards, tiny_config, plant):
    parts = eager_parts(tiny_config("optimizer=muon"), shards)
    opt = parts.optimizer
    w = parts.model.model.layers[1].mlp.up_proj.weight
    muon = next(g for g in opt.param_groups if g["kind"] == "muon")
    muon["params"] = [p for p in muon["params"] if p is not w]
    if plant == "in more than one group":  # Muon's and AdamW's: two updates a step
        muon["params"].append(w)
        opt.param_groups[-1]["params"].append(w)
    lines = []
    with pytest.raises(VerificationError, match="groups"):
        verify_before_training(parts, lines.append)
    row = next(line for line in lines if "FAIL groups" in line)
    assert plant in row and "model.layers.1.mlp.up_proj.weight" in row
