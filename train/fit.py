"""`doel-train fit`: shards → a trained model in Hugging Face layout, resumable exactly.

Order of a run: resolve device and dtype → build or resume (latest checkpoint in RUN_DIR) →
gradient-flow gate on the first batch (refuses to train on failure) → steps with periodic
logging, validation and atomic checkpoints → RUN_DIR/final/. Running the same command again
continues from the last checkpoint; `fresh=True` starts over.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from train.checkpoint import latest_checkpoint, load_checkpoint
from train.common import DoelError, atomic_write_json
from train.config import resolved
from train.dist import (
    DistInfo,
    collective_timeout_message,
    full_model_state,
    init_distributed,
    shutdown,
    wrap_model,
)
from train.gradflow import check_gradient_flow
from train.hf import save_model
from train.loader import TokenLoader, read_meta
from train.loop import RunLoop, batches_on
from train.metrics import MetricsLog, peak_flops
from train.model import Llama
from train.trainer import (
    TrainConfig,
    autocast,
    build_optimizer,
    resolve_dtype,
)
from train.verify import select, verify_before_training


class GradientFlowError(DoelError):
    pass


def check_vocab(meta: dict, cfg: TrainConfig) -> None:
    if meta["tokenizer"]["vocab_size"] > cfg.model.vocab_size:
        raise DoelError(
            f"the shards use a vocabulary of {meta['tokenizer']['vocab_size']} tokens but "
            f"model.vocab_size is {cfg.model.vocab_size}; raise it (--set model.vocab_size=...)"
        )


def _tokenizer_for(meta: dict, tokenizer, data_dir) -> Path | None:
    path = Path(tokenizer) if tokenizer else Path(meta["tokenizer"]["path"])
    if path.is_file():
        return path
    if tokenizer:
        raise DoelError(f"tokenizer not found: {tokenizer}")
    return None  # the shards' tokenizer moved: the model folder will lack tokenizer.json


def gradient_gate(model, loader, device, ctx, log) -> None:
    """Run the gate on the next batch without consuming it from the loader."""
    state = loader.state_dict()
    ((x, y),) = batches_on(loader, device, 1)
    loader.load_state_dict(state)

    def loss_fn(m, batch):  # the training step's own call, so a compiled graph is reused
        with ctx():
            return m(*batch, reduction="sum") / batch[1].numel()

    report = check_gradient_flow(model, (x, y), loss_fn=loss_fn)
    log(report.format())
    if not report.ok:
        raise GradientFlowError("refusing to train: the gradient-flow gate failed (above)")


def _compiled(model, loader, device, ctx, log):
    """torch.compile the model, or say loudly why the run falls back to eager (e.g. no C
    compiler for inductor's CPU kernels)."""
    log("compiling the model (the first step takes longer)")
    compiled = torch.compile(model)
    state = loader.state_dict()
    ((x, y),) = batches_on(loader, device, 1)
    loader.load_state_dict(state)
    try:
        with ctx():
            compiled(x, y, reduction="sum").backward()
    except Exception as e:  # noqa: BLE001 (inductor raises many kinds)
        log(f"WARNING: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eager")
        compiled = model
    model.zero_grad(set_to_none=True)
    return compiled


def _describe(model, cfg: TrainConfig, device, dtype, info: DistInfo, log) -> dict:
    flops = model.flops_per_token(cfg.seq_len)
    peak, source = peak_flops(device, dtype)
    n = model.num_parameters()
    par = f", {info.world_size} ranks ({cfg.strategy})" if info.enabled else ""
    log(
        f"model: {n / 1e6:.2f}M parameters ({model.num_parameters(True) / 1e6:.2f}M without "
        f"the embedding); {cfg.tokens_per_step * info.world_size:,} tokens a step; device "
        f"{device}, {dtype}{par}"
    )
    log(
        f"FLOPs/token = 6·(matmul weights, head included) + 6·L·H·D·T (causal attention) = "
        f"{flops['dense'] / 1e6:.1f}M + {flops['attention'] / 1e6:.1f}M = "
        f"{flops['total'] / 1e6:.1f}M; peak {peak / 1e12 if peak else float('nan'):.1f} "
        f"TFLOP/s ({source})"
    )
    return {
        "flops_per_token": flops["total"],
        "peak_flops": peak,
        "world": info.world_size,
        "tokens_per_step": cfg.tokens_per_step * info.world_size,
    }


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
    except (RuntimeError, torch.distributed.DistError) as e:
        text = str(e).lower()
        if info.enabled and ("timed out" in text or "timeout" in text):
            raise DoelError(collective_timeout_message(info, cfg.dist_timeout, e)) from e
        raise
    finally:
        shutdown()


def _fit(cfg, data_dir, out, tokenizer, fresh, log, step_hook, info, device, skip_verify):
    dtype = resolve_dtype(cfg.dtype, device)
    ctx = lambda: autocast(device, dtype)  # noqa: E731
    meta = read_meta(data_dir)
    check_vocab(meta, cfg)
    tok_path = _tokenizer_for(meta, tokenizer, data_dir)
    resume_from = _prepare_run_dir(out, cfg, fresh, info)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    with torch.device(device):
        model = Llama(cfg.model)
    wrapped = wrap_model(model, cfg.strategy, info, device, dtype, cfg.activation_checkpointing)
    optimizer = build_optimizer(wrapped, cfg, device)  # after FSDP: on the sharded parameters
    loader = TokenLoader(
        data_dir,
        "train",
        cfg.batch_size,
        cfg.seq_len,
        cfg.seed,
        rank=info.rank,
        world_size=info.world_size,
    )
    step, tokens_seen = 0, 0
    if resume_from is not None:
        _, state = load_checkpoint(resume_from, wrapped, optimizer)
        loader.load_state_dict(state["loader"])
        step, tokens_seen = state["step"], state.get("tokens_seen", 0)
        log(f"resuming from {resume_from} (step {step})")
    desc = _describe(model, cfg, device, dtype, info, log)
    fwd = _compiled(wrapped, loader, device, ctx, log) if cfg.compile else wrapped
    if skip_verify:
        log(
            "WARNING: --skip-verify: the verification suite did not run, so the silent failures "
            "it catches would go unnoticed; only the gradient-flow gate runs"
        )
        gradient_gate(fwd, loader, device, ctx, log)  # on the exact (wrapped, compiled) model
    else:  # the fast subset, gradient flow included, on the run's own objects
        names = None
        if info.enabled:
            # Parity compares a rank's gradients with a local eager pass, but DDP/FSDP average
            # gradients over ranks holding other data, and the step check mirrors the optimizer
            # onto a plain model (FSDP's are sharded): both run in `doel-train verify` on one
            # process. Gradient flow and ties (identity and shared gradient) run under the
            # wrapper.
            names = [n for n in select("fast") if n not in ("parity", "step")]
        verify_before_training(
            cfg,
            wrapped,
            fwd,
            optimizer,
            loader,
            device,
            dtype,
            log,
            out_dir=out / "verify" if info.is_main else None,
            names=names,
        )
    metrics = (
        MetricsLog(out / "metrics.jsonl", resume_step=step if resume_from else None)
        if info.is_main
        else None
    )
    run = RunLoop(
        cfg,
        model,
        fwd,
        optimizer,
        loader,
        device,
        ctx,
        metrics,
        out,
        tok_path,
        desc,
        log,
        info,
        step_hook,
    )
    try:
        run.loop(step, tokens_seen, meta)
    finally:
        if metrics:
            metrics.close()
    final = _save_final(wrapped, model, out, tok_path, cfg, info, log)
    run.card(final)
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
