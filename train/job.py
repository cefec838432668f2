"""The skeleton `fit` and `sft` share, from the process group to RUN_DIR/final.

`launch` (process group, the run folder locked, rank-0 logging; Ctrl-C and a time-out: one line) →
`Job.prepare` (--fresh, train_config.json, the latest checkpoint to resume from) → the caller
builds its `Parts` with `build_parts`, which resumes model, optimizer, RNG and loader, whatever
the loader → `Job.train`: the checks before step 1, not repeated on an unchanged resume
(`verify_key`), or with --skip-verify the gradient-flow gate alone → metrics.jsonl → the
`StepLoop` → RUN_DIR/final and its card. What differs between fit and sft comes in as
arguments: the model and loader (in the Parts), the `Checks` and what their key depends on, the
loop class (sft's validates on held-out conversations) and the card's extra inputs. One
skeleton, so that a resume, a Ctrl-C and a cached check behave alike in both commands.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from doel.contracts import checksums, read_json
from doel.contracts.lock import FolderLock
from doel.train.build import Parts
from doel.train.checkpoint import latest_checkpoint
from doel.train.common import DoelError, Interrupted, atomic_write_json
from doel.train.config import resolved
from doel.train.dist import (
    DistInfo,
    collective_timeout,
    collective_timeout_message,
    full_model_state,
    init_distributed,
    require_shared_folder,
    set_collective_timeout,
    shutdown,
)
from doel.train.gradflow import check_gradient_flow, step_loss
from doel.train.hf import save_model
from doel.train.loop import StepLoop
from doel.train.metrics import MetricsLog
from doel.train.threads import thread_hook

VERIFIED = "verify/passed.json"  # what the checks before step 1 passed on (verify_key)
CLEARED = ("checkpoints", "final", "metrics.jsonl")  # what --fresh removes in every run


class GradientFlowError(DoelError):
    pass


def launch(cfg, out_dir, body: Callable[[Job], Path], *, command: str, log=print, **asked) -> Path:
    """Run `body(job)` in the process group torchrun set up (or one process), with the run
    folder locked (`command` names the holder to a second process); rank 0 alone logs.
    `asked`: fresh, skip_verify, no_checksums, step_hook (Job's fields). Ctrl-C before the steps
    or while saving the final model, and a collective that timed out, end in one line that
    says what to do."""
    out = Path(out_dir)
    info, device = init_distributed(cfg.device, cfg.dist_setup_timeout)  # until step 1
    log = log if info.is_main else (lambda *_: None)
    lock = None
    try:
        lock = lock_run(out, f"doel-train {command}", info)
        require_shared_folder(out, info)  # across nodes: one run folder, not one a node
        return body(Job(out=out, info=info, device=device, log=log, **asked))
    except DoelError:
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {resume_note(out)}") from None
    except (RuntimeError, torch.distributed.DistError) as e:
        text = str(e).lower()
        if info.enabled and ("timed out" in text or "timeout" in text):
            raise DoelError(collective_timeout_message(info, collective_timeout(), e)) from e
        raise
    finally:
        if lock is not None:
            lock.release()
        shutdown()


def lock_run(out: Path, what: str, info: DistInfo) -> FolderLock | None:
    """Rank 0 locks the run folder (`FolderLock`) and every rank learns whether it
    could: a refused run ends on all ranks at once, none left waiting in a collective."""
    lock, problem = None, None
    if info.is_main:
        try:
            lock = FolderLock(out, what, DoelError).acquire()
        except DoelError as e:
            problem = str(e)
    if info.enabled:
        box = [problem]
        torch.distributed.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise DoelError(problem if info.is_main else f"rank 0: {problem}")
    return lock


@dataclass(frozen=True)
class Checks:
    """A run's checks before step 1. `perform(out_dir)` runs them, writes the report to out_dir
    when given (rank 0) and raises on a failure; `inputs()` is what their result depends on
    besides the config, world size and torch (hashes of the data, of the base model), called
    only when the checks are not skipped; `skipped` names what --skip-verify leaves out."""

    perform: Callable[[Path | None], object]
    inputs: Callable[[], dict]
    skipped: str


def verify_key(cfg, info: DistInfo, inputs: dict) -> dict:
    """What the checks before step 1 depend on: the resolved config, the run's own `inputs`,
    the world size and torch. Equal on resume: the checks are not rerun."""
    return {
        "config": resolved(cfg),
        **inputs,
        "world_size": info.world_size,
        "torch": torch.__version__,
    }


def resume_note(out: Path) -> str:
    last = latest_checkpoint(out)
    if last is None:
        return "no checkpoint was written yet; run the same command to start again"
    return f"the last checkpoint is {last}; run the same command to resume from it"


def gradient_gate(parts: Parts, log) -> None:
    """Run the gate on the exact model the step calls (wrapped, compiled) and the loader's next
    batch, without consuming it."""
    x, y = (torch.as_tensor(a, device=parts.device) for a in parts.loader.peek(1)[0])
    report = check_gradient_flow(parts.compiled, (x, y), loss_fn=step_loss(parts.ctx))
    log(report.format())
    if not report.ok:
        raise GradientFlowError("refusing to train: the gradient-flow gate failed (above)")


@dataclass(kw_only=True)
class Job:
    """One call of fit or sft: the process group it runs in, its run folder and what the
    caller asked. `resume_from` is the checkpoint `prepare` found."""

    out: Path
    info: DistInfo
    device: torch.device
    log: Callable[[str], object]
    fresh: bool = False
    skip_verify: bool = False
    no_checksums: bool = False  # the recorded hashes of shards and checkpoints go unchecked
    step_hook: Callable[[int], object] | None = None
    resume_from: Path | None = None

    def prepare(self, cfg, clear: tuple[str, ...] = (), then=None) -> Path | None:
        """The run folder: with --fresh, CLEARED and `clear` removed; train_config.json written
        and `then(out)` called on rank 0 (sft: the chat tokenizer); every rank waits for it.
        Returns the latest checkpoint, the one the run resumes from."""
        out = self.out
        if self.info.is_main:
            if self.fresh:
                for name in (*CLEARED, *clear):
                    path = out / name
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(True)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out / "train_config.json", resolved(cfg))
            if then is not None:
                then(out)
        if self.info.enabled:
            torch.distributed.barrier()
        self.resume_from = latest_checkpoint(out)
        return self.resume_from

    def train(
        self, parts: Parts, checks: Checks, *, tok_path, meta, loop=StepLoop, **loop_kw
    ) -> Path:
        """The checks before step 1, then the steps to RUN_DIR/final. `loop` is the StepLoop
        class (sft's ChatLoop) and `loop_kw` its own arguments; `meta` is what the card says
        about the data. Returns the final model folder."""
        self.verify(parts, checks)
        # Compiled and checked: from here a collective waits dist_timeout, not the setup's.
        set_collective_timeout(self.info, parts.cfg.dist_timeout)
        metrics = None
        if self.info.is_main:  # a resumed run's file goes on from its step
            resume_step = parts.step if self.resume_from is not None else None
            metrics = MetricsLog(self.out / "metrics.jsonl", resume_step=resume_step)
        steps = loop(
            parts=parts,
            metrics=metrics,
            out=self.out,
            tok_path=tok_path,
            log=self.log,
            # on a CPU, the thread count measured on the steps themselves
            step_hook=thread_hook(parts.device, self.info.enabled, self.log, self.step_hook),
            **loop_kw,
        )
        return train_to_the_end(steps, parts, meta, metrics, self.info)

    def verify(self, parts: Parts, checks: Checks) -> None:
        """The checks, unless --skip-verify or an unchanged resume: then the gradient-flow gate
        alone, on the exact model the step calls. Under torchrun the checks always run: each
        rank would read its own copy of the key, and ranks that disagreed would wait forever
        in the checks' collectives."""
        out, info, log = self.out, self.info, self.log
        if self.skip_verify:
            log(f"WARNING: --skip-verify: {checks.skipped}; only the gradient-flow gate runs")
            gradient_gate(parts, log)
            return
        key = verify_key(parts.cfg, info, checks.inputs())
        if self.resume_from is not None and not info.enabled and read_json(out / VERIFIED) == key:
            log(
                f"verification: passed before step 1 of this unchanged run ({out / VERIFIED}); "
                "not repeated on resume, the gradient-flow gate runs"
            )
            gradient_gate(parts, log)
            return
        checks.perform(out / "verify" if info.is_main else None)
        if info.is_main:
            atomic_write_json(out / VERIFIED, key)


def train_to_the_end(loop: StepLoop, parts: Parts, meta: dict, metrics, info: DistInfo) -> Path:
    """The steps from the run's own, then the final model and its card; Ctrl-C is one line
    naming how to resume (checkpoints are atomic, so the last one is whole)."""
    out = loop.out
    try:
        loop.train_from(parts.step, parts.tokens_seen, meta)
    except KeyboardInterrupt:
        step = getattr(loop, "step", parts.step)
        raise Interrupted(f"interrupted at step {step}; {resume_note(out)}") from None
    finally:
        if metrics:
            metrics.close()
    final = _save_final(parts, out, loop.tok_path, info, loop.log)
    loop.card(final)
    return final


def _save_final(parts: Parts, out: Path, tok_path, info: DistInfo, log) -> Path:
    """The full model, gathered to rank 0, written atomically to RUN_DIR/final."""
    model_sd = full_model_state(parts.wrapped)
    final = out / "final"
    if info.is_main:
        tmp = out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(
            parts.model,
            tmp,
            tokenizer=tok_path,
            state_dict=model_sd,
            extra_json={"train_config.json": resolved(parts.cfg)},
        )
        atomic_write_json(tmp / checksums.NAME, checksums.record(tmp))  # doel-export checks it
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        log(f"final model: {final}")
    if info.enabled:
        torch.distributed.barrier()
    return final
