"""The step loop of a run and its bookkeeping: logging (tokens/s, MFU, ETA), the time and cost
projection, periodic validation, checkpoints, and the non-finite-loss stop. It steps the
`Parts` that `build_parts` built and `Job.train` hands it; kept apart from them so that `fit`
and `sft` read as recipes. The loss is checked for NaN only where it is logged or saved: a
check each step would make the host wait for the device each step.
"""

from __future__ import annotations

import math
import time

import torch

from doel.train.checkpoint import save_checkpoint
from doel.train.common import Damaged, DoelError
from doel.train.config import resolved
from doel.train.data.loader import TokenLoader
from doel.train.data.tokenizer import load_tokenizer
from doel.train.dist import heartbeat
from doel.train.evals.modelcard import write_model_card
from doel.train.evals.scoring import task_accuracy
from doel.train.evals.tasks import load_task
from doel.train.metrics import format_duration, mfu
from doel.train.prefetch import Prefetcher, to_device
from doel.train.step import (
    lr_at,
    micro_batches_per_update,
    take_step,
    updates_before,
    validation_loss,
)


class NonFiniteLossError(DoelError):
    pass


def batches_on(loader, device, n):
    """The next n batches of the loader as tensors on the device (pinned, non-blocking copies
    on CUDA: train/prefetch.py)."""
    return [to_device(loader.next_batch(), device) for _ in range(n)]


class StepLoop:
    """The step loop and its bookkeeping (kept apart so `fit` and `sft` read as recipes)."""

    def __init__(self, *, parts, metrics, out, tok_path, log, step_hook=None, card_extra=None):
        """`parts`: what `build_parts` built (model, compiled, optimizer, loader, device,
        dtype, info, desc); `metrics` the MetricsLog (None off rank 0); `tok_path` the
        tokenizer.json copied into checkpoints; `card_extra` more of write_model_card's
        inputs (sft: the base model and the data)."""
        self.cfg, self.model, self.fwd, self.optimizer = (
            parts.cfg,
            parts.model,
            parts.compiled,
            parts.optimizer,
        )
        self.loader, self.device, self.ctx, self.metrics = (
            parts.loader,
            parts.device,
            parts.ctx,
            metrics,
        )
        self.out, self.tok_path, self.desc, self.log = out, tok_path, parts.desc, log
        self.info, self.step_hook = parts.info, step_hook
        self.write = metrics.write if metrics else (lambda row: None)
        self.bad_step = torch.full((), -1, dtype=torch.long, device=parts.device)
        self.last_ckpt = None
        self._task_items, self._task_tok, self._task_warned = None, None, False
        self.card_extra: dict = card_extra or {}

    def train_from(self, step: int, tokens_seen: int, meta: dict) -> None:
        cfg = self.cfg
        t_train, t_mark, step_mark, start_step = 0.0, time.perf_counter(), step, step
        projected, self.meta = False, meta
        # Earlier attempts' training time (metrics.jsonl keeps it across resumes): the card's
        # time and cost are those of every attempt, not of the last one.
        earlier = self.metrics.earlier_seconds if self.metrics else 0.0
        self.step, self.tokens_seen, self.seconds = step, tokens_seen, earlier
        self.updates = updates_before(step, cfg)  # optimizer updates: more than steps in a ramp
        # The next step's batches are read and sent while this one computes; checkpoints keep
        # the loader's state before them (self.batches.state_dict()).
        self.batches = Prefetcher(self.loader, self.device, cfg.grad_accum)
        while step < cfg.steps:
            heartbeat(self.info, step + 1)
            t0 = time.perf_counter()
            batches = self.batches.next()
            per_update = micro_batches_per_update(step, cfg)
            out = take_step(
                self.fwd,
                self.optimizer,
                batches,
                per_update,
                lr_at(step, cfg),
                cfg.grad_clip,
                self.ctx,
            )
            if step + 1 < cfg.steps:  # the step's kernels are queued: read the next one's
                self.batches.prefetch()
            self.updates += out["updates"]
            finite = torch.isfinite(out["loss"])
            self.bad_step = torch.where(~finite & (self.bad_step < 0), step + 1, self.bad_step)
            # int64 on the device: exact over billions of tokens, and no host sync.
            step, tokens_seen = step + 1, tokens_seen + out["tokens"].long()
            if self.step_hook is not None:
                self.step_hook(step)
            t_train += time.perf_counter() - t0
            self.step, self.tokens_seen, self.seconds = step, tokens_seen, earlier + t_train
            last = step == cfg.steps or (cfg.time_limit and t_train >= cfg.time_limit)
            if step % cfg.log_every == 0 or last:
                self._check_finite()
                dt = time.perf_counter() - t_mark
                self._log_step(
                    step,
                    out,
                    (step - step_mark) * self.desc["tokens_per_step"] / dt,
                    dt / (step - step_mark),
                    tokens_seen,
                )
                if not projected and step - start_step >= 3:
                    self._projection(step, dt / (step - step_mark))
                    projected = True
            if cfg.eval_every and (step % cfg.eval_every == 0 or last):
                self._validate(step, meta)
            if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or last):
                self._save(step, tokens_seen)
            if step % cfg.log_every == 0 or last:
                t_mark, step_mark = time.perf_counter(), step
            if last:
                break
        self._why_stopped(step, start_step, t_train)

    def _why_stopped(self, step: int, start_step: int, t_train: float) -> None:
        """One line that says when and why training stopped: a run that ends early by its
        time limit, or has nothing left to do, must not look like a finished one."""
        cfg = self.cfg
        if start_step >= cfg.steps:
            self.log(
                f"nothing to train: this run finished all {cfg.steps} steps before; the model "
                "is unchanged (--fresh starts over)"
            )
        elif step < cfg.steps:
            self.log(
                f"stopped early at step {step} of {cfg.steps}: time_limit={cfg.time_limit:g} s "
                f"of training reached ({format_duration(t_train)} in this attempt); the model "
                "is saved as it is now. Run the same command again to train the remaining "
                f"{cfg.steps - step} steps, or raise time_limit"
            )
        else:
            self.log(f"finished: {cfg.steps} steps ({format_duration(t_train)} in this attempt)")

    def _check_finite(self) -> None:
        bad = int(self.bad_step)
        if bad >= 0:
            keep = (
                f"the last good checkpoint is {self.last_ckpt}"
                if self.last_ckpt
                else ("no checkpoint was written before it")
            )
            raise NonFiniteLossError(
                f"the loss became non-finite at step {bad}; stopping. {keep}. Lower lr, "
                "check the data, or run `doel-train check-gradients`"
            )

    def _log_step(self, step, out, tokens_per_s, sec_per_step, tokens_seen) -> None:
        cfg, desc = self.cfg, self.desc
        loss, gnorm = float(out["loss"]), float(out["grad_norm"])
        # MFU per device: the global rate shared by world devices, against one device's peak.
        util = mfu(tokens_per_s, desc["flops_per_token"], desc["peak_flops"], desc["world"])
        eta = format_duration((cfg.steps - step) * sec_per_step)
        lr = lr_at(step - 1, cfg)
        ramp = ""
        if cfg.batch_ramp_fraction:  # the updates so far, and the rows of each in this step
            rows = micro_batches_per_update(step - 1, cfg) * cfg.batch_size * desc["world"]
            ramp = f" | {self.updates} updates ({rows} rows each)"
        self.log(
            f"step {step:>6}/{cfg.steps} | loss {loss:.4f} | lr {lr:.2e} | grad {gnorm:.3f} | "
            f"{tokens_per_s:,.0f} tok/s{' (global)' if desc['world'] > 1 else ''} | "
            f"MFU {f'{100 * util:.1f}%' if math.isfinite(util) else 'n/a'} | ETA {eta}{ramp}"
        )
        self.write(
            {
                "kind": "train",
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": gnorm,
                "updates": self.updates,
                "tokens_per_s": tokens_per_s,
                "mfu": util,
                "tokens": int(tokens_seen),
                "seconds": self.seconds,
                "time": time.time(),
            }
        )

    def _projection(self, step, sec_per_step) -> None:
        total = self.cfg.steps * sec_per_step
        cost, world = "", self.desc["world"]
        if self.device.type == "cuda":
            gpu_hours = total / 3600 * world
            cost = (
                f", about ${gpu_hours * self.cfg.hourly_price:,.2f} at "
                f"${self.cfg.hourly_price:.2f}/GPU-hour × {world} GPU(s)"
            )
        tokens = self.cfg.steps * self.desc["tokens_per_step"]
        ramp = ""
        if micro_batches_per_update(step - 1, self.cfg) < self.cfg.grad_accum:
            ramp = ", in the batch ramp: slower than later steps"
        self.log(
            f"projected: {self.cfg.steps} steps × {sec_per_step:.3f} s = {format_duration(total)}"
            f" for {tokens / 1e6:,.1f}M tokens{cost}; "
            f"{format_duration((self.cfg.steps - step) * sec_per_step)} left (the steps alone, "
            f"timed up to step {step}{ramp}"
            "; validation and checkpoints come on top)"
        )

    def _validate(self, step, meta) -> None:
        try:
            val = TokenLoader(
                self.loader.data_dir,
                "val",
                self.cfg.batch_size,
                self.cfg.seq_len,
                seed=0,
                verify=getattr(self.loader, "verify", True),
            )
        except Damaged:  # a damaged split is said, not taken for a missing one
            raise
        except (DoelError, KeyError):
            return  # no (or too small a) validation split: nothing to report
        n = min(self.cfg.eval_batches, val.n_windows // self.cfg.batch_size)
        # Eager model: a compiled one would recompile for no_grad/eval mode.
        loss = validation_loss(
            self.model, (val.next_batch() for _ in range(n)), self.device, self.ctx
        )
        chars = sum(s.get("val_characters", 0) for s in meta["sources"].values())
        toks = sum(s.get("val_tokens", 0) for s in meta["sources"].values())
        bpc = loss * toks / chars / math.log(2) if chars else float("nan")
        self.log(f"validation at step {step}: {loss:.4f} nats/token, ≈{bpc:.3f} bits/char")
        self.write({"kind": "val", "step": step, "loss": loss, "bits_per_char": bpc})
        if self.cfg.eval_task:
            self._task(step)

    def _task(self, step) -> None:
        """Accuracy on the fixed first items of a multiple-choice task. Scored by rank 0 on
        its own copy of the weights, so it cannot run on FSDP shards (said once)."""
        if self.info.enabled and self.cfg.strategy == "fsdp":
            if not self._task_warned:
                self.log("note: eval_task is skipped under FSDP (rank 0 holds only a shard)")
                self._task_warned = True
            return
        if not self.info.is_main:
            return
        name, _, path = self.cfg.eval_task.partition("=")
        if self._task_items is None:
            self._task_items = load_task(name, path, limit=self.cfg.eval_task_limit)
            self._task_tok = load_tokenizer(self.tok_path)
        with self.ctx():  # the run's autocast: fp32 with GQA would take SDPA's math kernel
            r = task_accuracy(self.model, self._task_tok, self._task_items, device=self.device)
        self.log(
            f"{name} at step {step}: acc {r['acc']:.3f} ± {r['acc_stderr']:.3f}, "
            f"acc_norm {r['acc_norm']:.3f} (chance {r['chance']:.3f}, {r['items']} items)"
        )
        self.write({"kind": "task", "step": step, "task": name, **r})

    def _save(self, step, tokens_seen) -> None:
        self._check_finite()
        state = {
            "loader": self.batches.state_dict(),  # before any step read ahead
            "tokens_seen": int(tokens_seen),
            "config": resolved(self.cfg),
        }
        self.last_ckpt = save_checkpoint(
            self.out,
            step,
            self.model,
            self.optimizer,
            state,
            tokenizer=self.tok_path,
            keep=self.cfg.keep_checkpoints,
        )
        self.card(self.last_ckpt)

    def card(self, folder) -> None:
        """The model card (README.md) of a checkpoint or final folder; rank 0 only. A card
        that cannot be written is reported, not allowed to end the run."""
        if not self.info.is_main:
            return
        dev = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        try:
            write_model_card(
                folder,
                meta=self.meta,
                train_state={
                    "step": self.step,
                    "tokens_seen": int(self.tokens_seen),
                    "config": resolved(self.cfg),
                },
                hardware=f"{self.info.world_size} × {dev}",
                seconds=self.seconds,
                attempts=self.metrics.attempt if self.metrics else 1,
                devices=self.info.world_size,
                hourly_price=self.cfg.hourly_price if self.device.type == "cuda" else None,
                **self.card_extra,
            )
        except Exception as e:  # noqa: BLE001
            self.log(f"WARNING: no model card written in {folder}: {type(e).__name__}: {e}")
