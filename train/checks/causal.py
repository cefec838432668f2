"""Causal leak and label shift: perturbing token t+1 must change nothing the model predicts at
positions <= t; the loader's targets must be its inputs moved by one and the model's loss that
of its own logits against them; and a fresh model of the run's recipe must learn a copy task
(a a b b ...) to near-zero loss on the copies while new tokens stay unpredictable.
"""

from __future__ import annotations

import math

import torch

from doel.train.checks.base import CheckResult, Setup, low_precision, param_dtype
from doel.train.dist import unwrap
from doel.train.evals.heldout import causal_leak
from doel.train.model import IGNORE_INDEX


def _copy_batch(vocab: int, gen, rows=8, pairs=8, symbols=16):
    """Pairs a a b b c c ...: the second of each pair copies its predecessor, the first is new.
    Returns x, y (targets = inputs shifted by one; unpredictable targets set to ignore)."""
    seq = torch.randint(0, min(symbols, vocab), (rows, pairs), generator=gen)
    seq = (seq + 3) % vocab  # keep clear of the special ids at the bottom of the vocabulary
    seq = seq.repeat_interleave(2, dim=1)
    x, y = seq[:, :-1], seq[:, 1:].clone()
    fresh = y.clone()
    y[:, 1::2] = IGNORE_INDEX
    fresh[:, 0::2] = IGNORE_INDEX
    return x, y, fresh


# The copy task's Adam lr, min(1e-2, 3 x the run's lr), was calibrated on models up to 4 layers
# of 128; a deeper or wider model takes it scaled by sqrt(4 / layers) and sqrt(128 / hidden):
# Adam moves every weight by about lr a step whatever its size, so at 24 layers of 1024 the
# tiny models' rate would change the model's function by far more a step than at 2 layers of 64.
COPY_CALIBRATED = {"layers": 4, "hidden": 128}


def copy_lr(cfg, vcfg) -> float:
    """The copy task's Adam lr: vcfg.copy_lr when set, else the calibrated rate scaled down for
    depth and width beyond the models it was calibrated on (COPY_CALIBRATED)."""
    if vcfg.copy_lr:
        return vcfg.copy_lr
    m = cfg.model
    depth = min(1.0, COPY_CALIBRATED["layers"] / m.num_hidden_layers)
    width = min(1.0, COPY_CALIBRATED["hidden"] / m.hidden_size)
    return min(1e-2, 3 * cfg.lr) * (depth * width) ** 0.5


def copy_task(s: Setup) -> dict:
    """Train a fresh model of the run's recipe on the copy task with plain Adam; with the
    shift right, copied tokens reach ~0 loss while new tokens stay near ln(symbols)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(s.cfg.seed)
    model = s.make_model()
    vocab = unwrap(model).config.vocab_size
    lr = copy_lr(s.cfg, s.vcfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(s.vcfg.copy_steps):
        x, y, _ = (t.to(s.device) for t in _copy_batch(vocab, gen))
        with s.ctx():
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # deep models at a high lr stay stable
        opt.step()
    x, y, fresh = (t.to(s.device) for t in _copy_batch(vocab, gen, rows=64))
    with torch.no_grad(), s.ctx():
        copied, new = float(model(x, y)), float(model(x, fresh))
    return {"copied_loss": copied, "new_token_loss": new, "ln_symbols": math.log(16), "lr": lr}


def shift_consistency(s: Setup, x, y) -> dict:
    """Without training: the loader's targets are its inputs moved by one, and the model's
    loss is the mean of -log p(target t | inputs <= t) read off its own logits."""
    model = unwrap(s.fwd)
    with torch.no_grad(), s.ctx():
        # The mean: how a sum is normalised is the accumulation check's business.
        loss = float(model(x, y))
        logp = torch.log_softmax(model(x).float(), dim=-1)
    keep = y != IGNORE_INDEX
    manual = float(-logp.gather(-1, y.clamp_min(0)[..., None])[..., 0][keep].mean())
    return {
        # Where a target is set (chat data leaves the prompt's and the padding's unset).
        "loader_targets_shifted_by_one": bool(((y[:, :-1] == x[:, 1:]) | ~keep[:, :-1]).all()),
        "loss_vs_logits_error": abs(loss - manual) / max(abs(manual), 1e-12),
    }


def _causal_problems(s: Setup, leak: float, tol: float, shift: dict, copy: dict) -> list[str]:
    v, problems = s.vcfg, []
    if leak > tol:
        problems.append(
            f"future-token leak: replacing token t+1 changes log-probabilities at positions "
            f"<= t by up to {leak:.3g} (tolerance {tol:g})"
        )
    if not shift["loader_targets_shifted_by_one"]:
        problems.append("label shift: the loader's targets are not its inputs moved by one")
    if shift["loss_vs_logits_error"] > tol:
        problems.append(
            f"label shift: the model's loss is {shift['loss_vs_logits_error']:.1%} off the "
            "loss of its own logits against the targets given (it shifts them again?)"
        )
    if copy["copied_loss"] > v.copy_max_loss:
        problems.append(
            f"label shift: copied tokens still cost {copy['copied_loss']:.3f} nats after "
            f"{v.copy_steps} steps (want < {v.copy_max_loss}); targets are likely shifted twice "
            "or not aligned with inputs"
        )
    if copy["new_token_loss"] < 0.5 * copy["ln_symbols"]:
        problems.append(
            f"label shift: unpredictable tokens cost only {copy['new_token_loss']:.3f} nats "
            "(they should stay near ln 16): the model sees its targets"
        )
    return problems


def check_causal(s: Setup) -> CheckResult:
    v = s.vcfg
    x, y = (t[:2] for t in s.batch())
    n = x.size(1)
    positions = sorted(
        {round(i * (n - 2) / max(1, v.leak_positions - 1)) for i in range(v.leak_positions)}
    )
    with s.ctx():
        leak = causal_leak(unwrap(s.fwd), x, positions)
    tol = 1e-4 if low_precision(s.dtype, param_dtype(s.model)) == torch.float32 else 1e-2
    shift, copy = shift_consistency(s, x, y), copy_task(s)
    problems = _causal_problems(s, leak, tol, shift, copy)
    return CheckResult(
        "causal",
        "perturbing token t+1 changes nothing at positions <= t; targets are inputs moved by "
        "one and the loss is that of the logits against them; a copy task (a a b b ...) reaches "
        "near-zero loss on the copies while new tokens stay unpredictable",
        not problems,
        {"leak": leak, "tolerance": tol, "positions": positions, **shift, **copy},
        "; ".join(problems) or "causal, and targets are the next token",
    )
