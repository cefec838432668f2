"""Continued pretraining of an adapted model: `fit`'s machinery (train/job.py, build.py, loop.py)
with the adapted weights as the start instead of random ones.

The shards are `doel-train prepare`'s (the language balance by shares of characters, the
overlap check, exact resume), made with a copy of the adapted tokenizer in which the base's own
document markers carry doel's names: <|bos|> is the base's document separator (<|endoftext|>
where it has one) and <|eos|> its end-of-text token (the instruct model's <|im_end|>, the token
every runtime of the export stops at). Nothing else of the vocabulary changes, so each id in
the shards is the adapted model's id. The run is `fit`'s: the checks before step 1 (the fast
subset), the gradient-flow gate, checkpoints, validation, time limit and an exact resume from the
run folder; before step 1 a second gate (`rows_gate`) checks that the rows of the new tokens
and of the base's tokens both get a finite, non-zero gradient, since a new row that is frozen
or detached would leave the Bangla tokens at their initialisation for the whole run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch

from doel.contracts import read_json
from doel.train.build import build_parts
from doel.train.checks.base import VerifyConfig
from doel.train.checks.suite import fit_subset, verify_before_training
from doel.train.common import DoelError, atomic_write_bytes, atomic_write_json
from doel.train.config import resolved
from doel.train.data.prepare import prepare
from doel.train.data.tokenizer import BOS, EOS
from doel.train.fit import shards_key
from doel.train.hf import load_model, read_config
from doel.train.job import Checks, GradientFlowError, Job, launch
from doel.train.settings import TrainConfig

INPUTS = "shards-inputs.json"  # what the shards were made of, beside them
DOC_START = ("<|endoftext|>", "<s>", "<|begin_of_text|>")
_SPECIAL = {"SpecialToken": {"id": BOS, "type_id": 0}}
_A = {"Sequence": {"id": "A", "type_id": 0}}


def document_markers(model_dir: Path) -> tuple[int, int]:
    """(start, end) ids of a document in the shards: the base's separator and its stop token."""
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    names = {a["content"]: a["id"] for a in tok.get("added_tokens") or []}
    cfg = read_config(model_dir)
    start = next((names[n] for n in DOC_START if n in names), cfg.bos_token_id)
    gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    stops = gen.get("eos_token_id", cfg.eos_token_id)
    end = stops[0] if isinstance(stops, list) else stops
    if start == end:  # one token both ends and starts: the next stop token ends
        end = next((s for s in (stops if isinstance(stops, list) else []) if s != start), None)
    if end is None or start is None:
        raise DoelError(f"{model_dir}: no distinct document start and end tokens to shard with")
    return start, end


def shard_tokenizer(model_dir: Path, out: Path) -> Path:
    """The adapted tokenizer with its document markers named <|bos|> and <|eos|> and <|bos|>
    put before each document (what prepare reads); written to out/tokenizer.json."""
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    start, end = document_markers(model_dir)
    data = copy.deepcopy(data)
    vocab = data["model"]["vocab"]
    for added in data["added_tokens"]:
        for i, name in ((start, BOS), (end, EOS)):
            if added["id"] == i:
                vocab.pop(added["content"], None)
                added["content"] = name
                vocab[name] = i
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [_SPECIAL, _A],
        "pair": [_A, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [start], "tokens": [BOS]}},
    }
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, ensure_ascii=False, indent=1)
    atomic_write_bytes(out / "tokenizer.json", text.encode("utf-8"))
    return out / "tokenizer.json"


def make_shards(model_dir: Path, data, out: Path, cfg, weights=(), val=(), log=print) -> dict:
    """The shards of `data` in the adapted vocabulary (out/shards), resumable as prepare is."""
    tok = shard_tokenizer(model_dir, out / "shard-tokenizer")
    asked = {
        "data": list(data),
        "weights": list(weights),
        "val": list(val),
        "config": resolved(cfg),
    }
    made = out / "shards" / "meta.json"
    if made.is_file() and read_json(out / INPUTS) == asked:
        return json.loads(made.read_text(encoding="utf-8"))
    meta = prepare(tok, data, out / "shards", cfg, weights, val, progress=False, log=log)
    atomic_write_json(out / INPUTS, asked)  # other text or settings next time: made again
    return meta


def rows_gate(parts, n_base: int, log) -> None:
    """One batch forward and backward: the embedding rows of the base's tokens and of the new
    ones in it (and every row, through a tied head) get a finite, non-zero gradient."""
    model = parts.model
    x, y = (torch.as_tensor(a, device=parts.device) for a in parts.loader.peek(1)[0])
    model.zero_grad(set_to_none=True)
    with parts.ctx():
        model(x, y).backward()
    grad = model.model.embed_tokens.weight.grad if hasattr(model, "model") else None
    grad = grad if grad is not None else next(p.grad for p in model.parameters())
    model.zero_grad(set_to_none=True)
    norms = grad.float().norm(dim=1)
    seen = torch.unique(x)
    groups = {"base": seen[seen < n_base], "new": seen[seen >= n_base]}
    if groups["new"].numel() == 0 and n_base < norms.numel():  # the head's new rows
        groups["new"] = torch.arange(n_base, norms.numel(), device=norms.device)
    bad = []
    for name, ids in groups.items():
        if ids.numel() and not (torch.isfinite(norms[ids]).all() and (norms[ids] > 0).all()):
            bad.append(
                f"{name} rows {ids[(norms[ids] == 0) | ~torch.isfinite(norms[ids])][:5].tolist()}"
            )
    counts = ", ".join(f"{len(v)} {k}" for k, v in groups.items())
    if bad:
        raise GradientFlowError(f"refusing to train: no or non-finite gradient at {'; '.join(bad)}")
    log(f"  pass rows          every embedding row of the batch gets a gradient ({counts})")


def continue_pretraining(
    cfg: TrainConfig, model_dir: Path, shards: Path, out: Path, n_base: int, log=print, **asked
) -> Path:
    """Train the adapted model in `model_dir` on `shards`; returns out/final. `asked`: fresh,
    skip_verify, no_checksums, step_hook (fit's). A rerun resumes from out's last checkpoint."""
    try:
        cfg = dataclasses.replace(cfg, model=read_config(model_dir))
    except ValueError as e:
        raise DoelError(f"invalid pretrain config with the model of {model_dir}: {e}") from None
    body = lambda job: _pretrain(job, cfg, model_dir, shards, n_base)  # noqa: E731
    return launch(cfg, out, body, command="adapt", log=log, **asked)


def _pretrain(job: Job, cfg: TrainConfig, model_dir: Path, shards: Path, n_base: int) -> Path:
    meta = json.loads((shards / "meta.json").read_text(encoding="utf-8"))
    if meta["tokenizer"]["vocab_size"] != cfg.model.vocab_size:
        raise DoelError(f"{shards}: made for another vocabulary; remove it and run again")
    job.prepare(cfg)
    log = job.log
    parts = build_parts(
        cfg,
        shards,
        model_factory=lambda c: load_model(model_dir, job.device),
        info=job.info,
        device=job.device,
        resume_from=job.resume_from,
        describe_to=log,
        log=log,
        checksums=not job.no_checksums,
    )
    rows_gate(parts, n_base, log)
    checks = Checks(
        # the copy task learns at a pretraining rate, as sft's does (a base's lr is too low)
        perform=lambda o: verify_before_training(
            parts,
            log,
            out_dir=o,
            names=fit_subset(job.info.enabled),
            vcfg=VerifyConfig(copy_lr=min(1e-2, max(3 * cfg.lr, 3e-3))),
        ),  # fmt: skip
        inputs=lambda: {"shards_sha256": shards_key(meta)},
        skipped="the verification suite did not run, so the silent failures it catches would "
        "go unnoticed",
    )
    return job.train(parts, checks, tok_path=model_dir / "tokenizer.json", meta=meta)
