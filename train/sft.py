"""`doel-train sft`: chat fine-tuning of a base checkpoint on conversations, resumable exactly.

Order of a run, on the skeleton it shares with fit (`Job`): the base model's config.json
replaces the config's [model] → the run folder and its tokenizer (the base's, its
<|reserved_0..3|> named as the turn markers if it predates them, so the chat template applies:
`chat_tokenizer`) → conversations read, checked and rendered (`load_chat_data`) →
`build_parts` with the base weights and a ChatLoader, resumed from the latest checkpoint in
RUN_DIR → the checks before step 1: gradient flow, parity, ties, causal, step, accumulation
and the loss-mask check (`check_loss_mask`) → the `StepLoop`'s steps (`ChatLoop`: validation
on held-out conversations) → RUN_DIR/final with a model card naming the base model (its path,
and the sha256 of its weights) and the data.

A run folder records the base it fine-tunes (RUN_DIR/base.json, by the sha256 of its weights):
when the base changed since (trained further, as a time-limited `fit` resumed later is), the
run starts over from the new base, instead of resuming or saying "nothing to train" over a
chat model of the old one (issue 38).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from doel.contracts import checksums, read_json
from doel.train.build import build_parts
from doel.train.checkpoint import latest_checkpoint
from doel.train.checks.base import Setup, VerifyConfig, fresh_like
from doel.train.checks.chat import check_loss_mask
from doel.train.checks.suite import SINGLE_PROCESS_ONLY, Report, require_pass, run_checks
from doel.train.common import Damaged, DoelError, atomic_write_json, sha256_file
from doel.train.data.chat import ChatData, ChatLoader, chat_tokenizer, load_chat_data
from doel.train.data.chat import special_ids as chat_special_ids
from doel.train.data.conversations import SFTConfig
from doel.train.data.tokenizer import load_tokenizer
from doel.train.dist import DistInfo
from doel.train.hf import WEIGHTS, load_model, read_config
from doel.train.job import VERIFIED, Checks, Job, launch
from doel.train.loop import StepLoop
from doel.train.step import validation_loss

# The fast subset's checks that run on chat batches; data and tokenizer read token shards.
CHAT_CHECKS = ("gradient_flow", "parity", "ties", "causal", "step", "accumulation")
BASE = "base.json"  # in the run folder: the base model it fine-tunes, {"path", "sha256"}


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


class ChatLoop(StepLoop):
    """StepLoop with validation on held-out conversations (assistant tokens only)."""

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
    no_checksums: bool = False,
) -> Path:
    """Fine-tune the model folder `base` on the conversations in `data` (files, folders,
    hf:NAME); returns RUN_DIR/final. Running it again on the same out_dir resumes (the
    checkpoint checked against its recorded hashes first, unless `no_checksums`)."""
    asked = {
        "fresh": fresh,
        "step_hook": step_hook,
        "skip_verify": skip_verify,
        "no_checksums": no_checksums,
    }
    return launch(
        cfg, out_dir, lambda job: _sft(job, cfg, data, Path(base)), command="sft", log=log, **asked
    )


def _sft(job: Job, cfg: SFTConfig, data: list[str], base: Path) -> Path:
    cfg, log, info = with_base_model(cfg, base), job.log, job.info
    verified = {}
    if not job.no_checksums:  # the base as fit wrote it: RUN/final records its files' hashes
        hint = "copy it again, or pass --no-checksums to use it as is"
        verified = checksums.verify(base, Damaged, hint=hint)
    base_sha = base_sha256(base, verified)
    if not job.fresh and (before := base_changed(job.out, base_sha)):
        log(
            f"the base model changed since this run fine-tuned it ({base}: weights sha256 "
            f"{before[:12]} then, {base_sha[:12]} now): fine-tuning again from the new base"
        )
        job.fresh = True

    def start(out: Path) -> None:
        chat_tokenizer(base, out / "tokenizer", log)
        atomic_write_json(out / BASE, {"path": str(base), "sha256": base_sha})

    # --fresh also clears the checks' report and the tokenizer, both made from the base.
    job.prepare(cfg, clear=("verify", "tokenizer", BASE), then=start)
    tok_path = job.out / "tokenizer" / "tokenizer.json"
    tok = load_tokenizer(tok_path)
    if tok.get_vocab_size() != cfg.model.vocab_size:
        raise DoelError(
            f"{base}: its tokenizer has {tok.get_vocab_size()} tokens, its model "
            f"{cfg.model.vocab_size}; a doel checkpoint has them equal"
        )
    special = chat_special_ids(tok)
    train, held = load_chat_data(data, tok, cfg, log)
    pad_share = 1 - train.stats["tokens"] / (len(train.ids) * (cfg.seq_len + 1))
    log(f"batches: one conversation a row, padded to {cfg.seq_len} ({pad_share:.0%} padding)")
    parts = build_parts(
        cfg,
        None,
        model_factory=lambda c: load_model(base, job.device),
        loader_factory=lambda: ChatLoader(
            train, cfg.batch_size, cfg.seq_len, cfg.seed, special, info.rank, info.world_size
        ),
        info=info,
        device=job.device,
        resume_from=job.resume_from,
        describe_to=log,
        log=log,
        checksums=not job.no_checksums,
    )
    checks = Checks(
        perform=lambda out: verify_chat(parts, cfg, tok_path, info, log, out_dir=out),
        inputs=lambda: {
            "base_sha256": base_sha,
            "data_sha256": train.fingerprint(),
        },
        skipped="the checks before step 1 did not run (the loss mask among them)",
    )
    card = {"finetune": _card_info(base, base_sha, data, train.stats)}
    meta = (read_json(base / "model_card.json") or {}).get("meta") or {}
    return job.train(
        parts,
        checks,
        tok_path=tok_path,
        meta=meta,
        loop=ChatLoop,
        held=held,
        special=special,
        card_extra=card,
    )


def base_sha256(base: Path, verified: dict[str, str]) -> str:
    """The sha256 of the base's weights: as just verified, else as its checksums.json records
    it (--no-checksums), else hashed here (a base written before doel recorded hashes)."""
    if WEIGHTS in verified:
        return verified[WEIGHTS]
    files = checksums.recorded(base, Damaged) or {}
    return files.get(WEIGHTS, {}).get("sha256") or sha256_file(base / WEIGHTS)


def base_changed(out: Path, sha: str) -> str | None:
    """The sha256 of the base the run folder `out` fine-tuned, when it has something to resume
    or keep (a checkpoint, a final model) and that base is not `sha`; None otherwise. A run
    from before base.json is read from its checks' key, which holds the same hash."""
    if latest_checkpoint(out) is None and not (out / "final").is_dir():
        return None
    before = (read_json(out / BASE) or {}).get("sha256")
    if before is None:
        before = (read_json(out / VERIFIED) or {}).get("base_sha256")
    return before if isinstance(before, str) and before != sha else None


def _card_info(base: Path, base_sha: str, data: list[str], stats: dict) -> dict:
    repo = (read_json(base / "model_card.json") or {}).get("repo_id")
    return {
        "base_model": str(base),
        "base_sha256": base_sha,
        "base_repo": repo if isinstance(repo, str) else None,
        "data": [str(d) for d in data],
        "stats": {k: v for k, v in stats.items() if k != "first_malformed"},
    }


def verify_chat(parts, cfg, tok_path, info: DistInfo, log=print, out_dir=None) -> Report:
    """The chat subset of the suite on the run's own objects, and the loss-mask check; the
    report is written to out_dir if given, and a failure raises VerificationError. The checks
    that train copies (step, the copy task) get fresh randomly initialised ones, as `fit`'s
    do: what they test is the training path, and a base's weights only slow a copy task down."""
    setup = Setup.from_parts(
        parts,
        Path(tok_path).parent,
        cfg=cfg,
        make_model=fresh_like(parts.model, parts.device),
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
    return require_pass(report, out_dir, log)
