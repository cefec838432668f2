"""`doel-train fit`: shards → a trained model in Hugging Face layout, resumable exactly.

Order of a run, on the skeleton it shares with sft (`Job`): the shards' meta.json and tokenizer
against the model → the run folder → `build_parts` (device, dtype, model, wrapper, optimizer,
loader, resume from the latest checkpoint in RUN_DIR, compile) → the fast subset of the
verification suite before step 1 (refuses to train on a failure; on an unchanged resume the
gradient-flow gate alone) → steps with periodic logging, validation and atomic checkpoints →
RUN_DIR/final. Running the same command again continues from the last
checkpoint; `fresh=True` starts over.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from doel.train.build import build_parts, check_vocab
from doel.train.checks.suite import fit_subset, verify_before_training
from doel.train.common import DoelError
from doel.train.data.loader import check_tokenizer, read_meta
from doel.train.job import Checks, Job, launch
from doel.train.settings import TrainConfig


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


def shards_key(meta: dict) -> str:
    """What the checks' result depends on in the shards' meta.json: the format, the tokenizer's
    hash, the shards' names, sizes and hashes, the settings. Not meta.json's own hash: it holds
    how long prepare took (seconds, tokens_per_second), new on every run of it, and where the
    files lay, so an unchanged resume would never find its checks passed before."""
    kept = {
        "format": meta["format"],
        "tokenizer": {k: v for k, v in meta["tokenizer"].items() if k != "path"},
        "splits": meta["splits"],
        "config": meta.get("config"),
    }
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def fit(
    cfg: TrainConfig,
    data_dir,
    out_dir,
    tokenizer=None,
    fresh=False,
    log=print,
    step_hook=None,
    skip_verify=False,
    no_checksums=False,
) -> Path:
    """Train per `cfg` on the shards in `data_dir`; returns the final model folder. Under
    torchrun every rank calls it; rank 0 logs and writes. `step_hook(step)` runs after each
    step (tests use it to plant a hang or a crash). `no_checksums`: the shards and the checkpoint
    resumed from are not checked against their recorded hashes."""
    asked = {
        "fresh": fresh,
        "step_hook": step_hook,
        "skip_verify": skip_verify,
        "no_checksums": no_checksums,
    }
    return launch(
        cfg,
        out_dir,
        lambda job: _fit(job, cfg, data_dir, tokenizer),
        command="fit",
        log=log,
        **asked,
    )


def _fit(job: Job, cfg: TrainConfig, data_dir, tokenizer) -> Path:
    meta = read_meta(data_dir)
    check_vocab(meta, cfg)  # before --fresh clears anything
    tok_path = _tokenizer_for(meta, tokenizer, data_dir)
    job.prepare(cfg)
    log = job.log
    parts = build_parts(
        cfg,
        data_dir,
        info=job.info,
        device=job.device,
        resume_from=job.resume_from,
        describe_to=log,
        log=log,
        checksums=not job.no_checksums,
    )
    checks = Checks(  # the fast subset, gradient flow included, on the run's own objects
        perform=lambda out: verify_before_training(
            parts, log, out_dir=out, names=fit_subset(job.info.enabled)
        ),
        inputs=lambda: {"shards_sha256": shards_key(meta)},
        skipped="the verification suite did not run, so the silent failures it catches would "
        "go unnoticed",
    )
    return job.train(parts, checks, tok_path=tok_path, meta=meta)
