"""`doel-train sft`: chat fine-tuning of a base checkpoint on conversations, resumable exactly.

Order of a run: the base model's config.json replaces the config's [model] → the run's
tokenizer (the base's, its <|reserved_0..3|> named as the turn markers if it predates them, so
the chat template applies; train/data/chat.py) → conversations read and checked
(train/data/conversations.py) and rendered (train/data/chat.py) → `build_run` with the base
weights and a ChatLoader (train/build.py) → resume from the latest checkpoint in RUN_DIR → the
checks before step 1: gradient flow, parity, ties, causal, step, accumulation and the loss-mask
check (train/checks/chat.py) → `RunLoop` steps (train/loop.py), validation on held-out
conversations → RUN_DIR/final with a model card naming the base model and the data.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from doel.train.build import build_run
from doel.train.checkpoint import latest_checkpoint, load_checkpoint
from doel.train.checks.base import Setup, VerifyConfig, fresh_like
from doel.train.checks.chat import check_loss_mask
from doel.train.checks.suite import SINGLE_PROCESS_ONLY, Report, VerificationError, run_checks
from doel.train.common import DoelError, Interrupted, atomic_write_json, sha256_file
from doel.train.config import resolved
from doel.train.data.chat import ChatData, ChatLoader, chat_tokenizer, load_chat_data
from doel.train.data.chat import special_ids as chat_special_ids
from doel.train.data.conversations import SFTConfig
from doel.train.data.tokenizer import load_tokenizer
from doel.train.dist import DistInfo, init_distributed, shutdown
from doel.train.fit import _resume_note, gradient_gate, run_to_the_end
from doel.train.hf import WEIGHTS, load_model, read_config
from doel.train.loop import RunLoop
from doel.train.metrics import MetricsLog
from doel.train.trainer import validation_loss

# The fast subset's checks that run on chat batches; data and tokenizer read token shards.
CHAT_CHECKS = ("gradient_flow", "parity", "ties", "causal", "step", "accumulation")
VERIFIED = "verify/passed.json"


def with_base_model(cfg: SFTConfig, base: Path) -> SFTConfig:
    """The config with the base checkpoint's model (config.json): fine-tuning keeps its shape."""
    for name in ("config.json", WEIGHTS):
        if not (base / name).is_file():
            raise DoelError(
                f"--from {base}: no {name}; pass a model folder that `doel-train fit` wrote "
                "(RUN/final or RUN/checkpoints/step-N)"
            )
    try:
        return dataclasses.replace(cfg, model=read_config(base))
    except ValueError as e:
        raise DoelError(f"invalid config with the model of {base}: {e}") from None


class ChatLoop(RunLoop):
    """RunLoop with validation on held-out conversations (assistant tokens only)."""

    def __init__(self, *, held: ChatData, special: dict, **kw):
        super().__init__(**kw)
        self.held, self.special = held, special

    def _validate(self, step, meta) -> None:
        if not self.held.ids:
            return
        rows = min(self.cfg.batch_size, len(self.held.ids))
        val = ChatLoader(self.held, rows, self.cfg.seq_len, 0, self.special)
        loss = validation_loss(self.model, val.batches(), self.device, self.ctx)
        self.log(
            f"validation at step {step}: {loss:.4f} nats/token on the assistant's tokens of "
            f"{val.n_windows} held-out conversations"
        )
        self.write({"kind": "val", "step": step, "loss": loss})


def sft(
    cfg: SFTConfig,
    data: list[str],
    base,
    out_dir,
    fresh: bool = False,
    log=print,
    step_hook=None,
    skip_verify: bool = False,
) -> Path:
    """Fine-tune the model folder `base` on the conversations in `data` (files, folders,
    hf:NAME); returns RUN_DIR/final. Running it again on the same out_dir resumes."""
    out = Path(out_dir)
    info, device = init_distributed(cfg.device, cfg.dist_timeout)
    log = log if info.is_main else (lambda *_: None)
    try:
        return _sft(cfg, data, Path(base), out, fresh, log, step_hook, skip_verify, info, device)
    except DoelError:
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {_resume_note(out)}") from None
    finally:
        shutdown()


def _prepare(out: Path, cfg, base: Path, fresh: bool, info: DistInfo, log) -> Path:
    """The run folder (cleared with fresh) and its tokenizer; returns tokenizer.json's path."""
    if info.is_main:
        if fresh:
            for name in ("checkpoints", "final", "metrics.jsonl", "verify", "tokenizer"):
                path = out / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(True)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "train_config.json", resolved(cfg))
        chat_tokenizer(base, out / "tokenizer", log)
    if info.enabled:
        torch.distributed.barrier()
    return out / "tokenizer" / "tokenizer.json"


def _sft(cfg, data, base, out, fresh, log, step_hook, skip_verify, info, device) -> Path:
    cfg = with_base_model(cfg, base)
    tok_path = _prepare(out, cfg, base, fresh, info, log)
    tok = load_tokenizer(tok_path)
    if tok.get_vocab_size() != cfg.model.vocab_size:
        raise DoelError(
            f"{base}: its tokenizer has {tok.get_vocab_size()} tokens, its model "
            f"{cfg.model.vocab_size}; a doel checkpoint has them equal"
        )
    special = chat_special_ids(tok)
    train, held = load_chat_data(data, tok, cfg, log)

    def make_loader() -> ChatLoader:
        return ChatLoader(
            train, cfg.batch_size, cfg.seq_len, cfg.seed, special, info.rank, info.world_size
        )

    loader = make_loader()
    pad_share = 1 - train.stats["tokens"] / (len(train.ids) * (cfg.seq_len + 1))
    log(f"batches: one conversation a row, padded to {cfg.seq_len} ({pad_share:.0%} padding)")
    resume_from = latest_checkpoint(out)
    # Resumed below rather than by build_run, which resumes only the shards' loader.
    run = build_run(
        cfg,
        None,
        model_factory=lambda c: load_model(base, device),
        info=info,
        device=device,
        example_batch=loader.peek(1)[0],
        describe_to=log,
        log=log,
    )
    run.loader, run.make_loader = loader, make_loader
    if resume_from is not None:
        _, state = load_checkpoint(resume_from, run.wrapped, run.optimizer)
        loader.load_state_dict(state["loader"])
        run.step, run.tokens_seen = state["step"], state.get("tokens_seen", 0)
        log(f"resuming from {resume_from} (step {run.step})")
    _verify(run, cfg, base, train, tok_path, out, resume_from, skip_verify, info, log)
    metrics = (
        MetricsLog(out / "metrics.jsonl", resume_step=run.step if resume_from else None)
        if info.is_main
        else None
    )
    loop = ChatLoop(
        run=run,
        metrics=metrics,
        out=out,
        tok_path=tok_path,
        log=log,
        step_hook=step_hook,
        held=held,
        special=special,
    )
    loop.card_extra = {"finetune": _card_info(base, data, train.stats)}
    base_card = _read_json(base / "model_card.json")
    return run_to_the_end(loop, run, (base_card or {}).get("meta") or {}, metrics, info)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _card_info(base: Path, data: list[str], stats: dict) -> dict:
    repo = (_read_json(base / "model_card.json") or {}).get("repo_id")
    return {
        "base_model": str(base),
        "base_repo": repo if isinstance(repo, str) else None,
        "data": [str(d) for d in data],
        "stats": {k: v for k, v in stats.items() if k != "first_malformed"},
    }


def _verify_key(cfg, base: Path, train: ChatData, info: DistInfo) -> dict:
    """What the checks before step 1 depend on; equal on resume: not rerun."""
    return {
        "config": resolved(cfg),
        "base_sha256": sha256_file(base / WEIGHTS),
        "data_sha256": train.fingerprint(),
        "world_size": info.world_size,
        "torch": torch.__version__,
    }


def _verify(run, cfg, base, train, tok_path, out, resume_from, skip_verify, info, log) -> None:
    if skip_verify:
        log(
            "WARNING: --skip-verify: the checks before step 1 did not run (the loss mask "
            "among them); only the gradient-flow gate runs"
        )
        gradient_gate(run, log)
        return
    key = _verify_key(cfg, base, train, info)
    if resume_from is not None and _read_json(out / VERIFIED) == key:
        log(f"verification: passed before step 1 of this unchanged run ({out / VERIFIED})")
        gradient_gate(run, log)
        return
    report = verify_chat(run, cfg, tok_path, info, log)
    if info.is_main:
        report.write(out / "verify")
    if not report.ok:
        raise VerificationError(
            f"refusing to train: verification failed ({', '.join(report.failed)}); see the rows "
            f"above and {out / 'verify' / 'verify.md'}"
        )
    if info.is_main:
        atomic_write_json(out / VERIFIED, key)


def verify_chat(run, cfg, tok_path, info: DistInfo, log=print) -> Report:
    """The chat subset of the suite on the run's own objects, and the loss-mask check. The
    checks that train copies (step, the copy task) get fresh randomly initialised ones, as
    `fit`'s do: what they test is the training path, and a base's weights only slow a copy
    task down."""
    setup = Setup.from_run(
        run,
        Path(tok_path).parent,
        cfg=cfg,
        make_model=fresh_like(run.model, run.device),
        tokenizer=Path(tok_path),
        # The causal check's copy task learns at a pre-training rate: at fine-tuning's (1e-4)
        # its 30 steps are too few to learn to copy, whatever the label shift.
        vcfg=VerifyConfig(copy_lr=min(1e-2, max(3 * cfg.lr, 3e-3))),
    )
    names = [n for n in CHAT_CHECKS if not (info.enabled and n in SINGLE_PROCESS_ONLY)]
    log("verifying before step 1 (the chat subset; --skip-verify skips it)")
    report = run_checks(setup, names, "chat", log=log)
    t = time.perf_counter()
    mask = check_loss_mask(setup)
    mask.seconds = time.perf_counter() - t
    log(f"  {mask.status:<4} {mask.name:<13} {mask.detail}")
    report.results.append(mask)
    report.seconds += mask.seconds
    log(report.summary())
    return report
