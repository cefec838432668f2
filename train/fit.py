"""`doel-train fit`: shards → a trained model in Hugging Face layout, resumable exactly.

Order of a run: `build_run` (train/build.py: device, dtype, model, wrapper, optimizer, loader,
resume from the latest checkpoint in RUN_DIR, compile) →
gradient-flow gate on the first batch (refuses to train on failure) → steps with periodic
logging, validation and atomic checkpoints → RUN_DIR/final/. Running the same command again
continues from the last checkpoint; `fresh=True` starts over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from doel.train.build import Run, build_run, check_vocab
from doel.train.checkpoint import latest_checkpoint
from doel.train.checks.suite import fit_subset, verify_before_training
from doel.train.common import DoelError, Interrupted, atomic_write_json, sha256_file
from doel.train.config import resolved
from doel.train.data.loader import check_tokenizer, read_meta
from doel.train.dist import (
    DistInfo,
    collective_timeout_message,
    full_model_state,
    init_distributed,
    shutdown,
)
from doel.train.gradflow import check_gradient_flow
from doel.train.hf import save_model
from doel.train.loop import RunLoop
from doel.train.metrics import MetricsLog
from doel.train.trainer import TrainConfig


class GradientFlowError(DoelError):
    pass


def _tokenizer_for(meta: dict, tokenizer, data_dir) -> Path | None:
    """The tokenizer.json copied into every checkpoint: the one that made the shards (its
    sha256 in meta.json), so its size is the model's vocab_size (check_vocab)."""
    path = Path(tokenizer) if tokenizer else Path(meta["tokenizer"]["path"])
    if path.is_file():
        check_tokenizer(meta, path, data_dir)
        return path
    if tokenizer:
        raise DoelError(f"tokenizer not found: {tokenizer}")
    return None  # the shards' tokenizer moved: the model folder will lack tokenizer.json


def gradient_gate(run: Run, log) -> None:
    """Run the gate on the exact model the step calls (wrapped, compiled) and the loader's next
    batch, without consuming it."""
    x, y = (torch.as_tensor(a, device=run.device) for a in run.loader.peek(1)[0])

    def loss_fn(m, batch):  # the training step's own call, so a compiled graph is reused
        with run.ctx():
            return m(*batch, reduction="sum") / batch[1].numel()

    report = check_gradient_flow(run.compiled, (x, y), loss_fn=loss_fn)
    log(report.format())
    if not report.ok:
        raise GradientFlowError("refusing to train: the gradient-flow gate failed (above)")


VERIFIED = "verify/passed.json"  # what the checks before step 1 passed on


def _verify_key(cfg, data_dir, info: DistInfo) -> dict:
    """What the checks before step 1 depend on: the resolved config, the shards' meta.json
    (tokenizer and data hashes), the world size and torch. Equal on resume: not rerun."""
    return {
        "config": resolved(cfg),
        "meta_sha256": sha256_file(Path(data_dir) / "meta.json"),
        "world_size": info.world_size,
        "torch": torch.__version__,
    }


def _verified_before(out: Path, cfg, data_dir, info: DistInfo) -> bool:
    try:
        return json.loads((out / VERIFIED).read_text()) == _verify_key(cfg, data_dir, info)
    except (OSError, ValueError):
        return False


def _resume_note(out: Path) -> str:
    last = latest_checkpoint(out)
    if last is None:
        return "no checkpoint was written yet; run the same command to start again"
    return f"the last checkpoint is {last}; run the same command to resume from it"


def _prepare_run_dir(out, cfg, fresh: bool, info: DistInfo) -> Path | None:
    out = Path(out)
    if info.is_main:
        if fresh:
            for name in ("checkpoints", "final", "metrics.jsonl"):
                path = out / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(True)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "train_config.json", resolved(cfg))
    if info.enabled:
        torch.distributed.barrier()
    return latest_checkpoint(out)


def fit(
    cfg: TrainConfig,
    data_dir,
    out_dir,
    tokenizer=None,
    fresh=False,
    log=print,
    step_hook=None,
    skip_verify=False,
) -> Path:
    """Train per `cfg` on the shards in `data_dir`; returns the final model folder. Under
    torchrun every rank calls it; rank 0 logs and writes. `step_hook(step)` runs after each
    step (tests use it to plant a hang or a crash)."""
    out = Path(out_dir)
    info, device = init_distributed(cfg.device, cfg.dist_timeout)
    log = log if info.is_main else (lambda *_: None)
    try:
        return _fit(cfg, data_dir, out, tokenizer, fresh, log, step_hook, info, device, skip_verify)
    except DoelError:
        raise
    except KeyboardInterrupt:  # before step 1 (checks, compilation) or saving the final model
        raise Interrupted(f"interrupted; {_resume_note(out)}") from None
    except (RuntimeError, torch.distributed.DistError) as e:
        text = str(e).lower()
        if info.enabled and ("timed out" in text or "timeout" in text):
            raise DoelError(collective_timeout_message(info, cfg.dist_timeout, e)) from e
        raise
    finally:
        shutdown()


def _fit(cfg, data_dir, out, tokenizer, fresh, log, step_hook, info, device, skip_verify):
    meta = read_meta(data_dir)
    check_vocab(meta, cfg)  # before --fresh clears anything
    tok_path = _tokenizer_for(meta, tokenizer, data_dir)
    resume_from = _prepare_run_dir(out, cfg, fresh, info)
    run = build_run(
        cfg, data_dir, info=info, device=device, resume_from=resume_from, describe_to=log, log=log
    )
    if skip_verify:
        log(
            "WARNING: --skip-verify: the verification suite did not run, so the silent failures "
            "it catches would go unnoticed; only the gradient-flow gate runs"
        )
        gradient_gate(run, log)  # on the exact (wrapped, compiled) model
    elif (
        resume_from is not None and not info.enabled and _verified_before(out, cfg, data_dir, info)
    ):
        log(
            f"verification: passed before step 1 of this unchanged run ({out / VERIFIED}); not "
            "repeated on resume, the gradient-flow gate runs"
        )
        gradient_gate(run, log)
    else:  # the fast subset, gradient flow included, on the run's own objects
        verify_before_training(
            cfg,
            run.wrapped,
            run.compiled,
            run.optimizer,
            run.loader,
            run.device,
            run.dtype,
            log,
            out_dir=out / "verify" if info.is_main else None,
            names=fit_subset(info.enabled),
        )
        if info.is_main:
            atomic_write_json(out / VERIFIED, _verify_key(cfg, data_dir, info))
    metrics = (
        MetricsLog(out / "metrics.jsonl", resume_step=run.step if resume_from else None)
        if info.is_main
        else None
    )
    loop = RunLoop(
        run=run, metrics=metrics, out=out, tok_path=tok_path, log=log, step_hook=step_hook
    )
    return run_to_the_end(loop, run, meta, metrics, info)


def run_to_the_end(loop: RunLoop, run, meta: dict, metrics, info) -> Path:
    """The steps from the run's own, then the final checkpoint and its card; Ctrl-C is one line
    naming how to resume (checkpoints are atomic, so the last one is whole). fit and sft both
    end here."""
    out = loop.out
    try:
        loop.loop(run.step, run.tokens_seen, meta)
    except KeyboardInterrupt:
        step = getattr(loop, "step", run.step)
        raise Interrupted(f"interrupted at step {step}; {_resume_note(out)}") from None
    finally:
        if metrics:
            metrics.close()
    final = _save_final(run.wrapped, run.model, out, loop.tok_path, loop.cfg, info, loop.log)
    loop.card(final)
    return final


def _save_final(wrapped, model, out, tok_path, cfg, info, log) -> Path:
    """The full model, gathered to rank 0, written atomically to RUN_DIR/final."""
    model_sd = full_model_state(wrapped)
    final = out / "final"
    if info.is_main:
        tmp = out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(
            model,
            tmp,
            tokenizer=tok_path,
            state_dict=model_sd,
            extra_json={"train_config.json": resolved(cfg)},
        )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        log(f"final model: {final}")
    if info.enabled:
        torch.distributed.barrier()
    return final
