"""Training checkpoints: a Hugging Face model folder plus everything needed to resume exactly.

`RUN_DIR/checkpoints/step-000200/` holds config.json, model.safetensors, tokenizer.json,
generation_config.json (loadable by transformers as is) and, for resuming, the optimizer's
tensors keyed by parameter name, trainer_state.json (step, optimizer hyper-parameters, loader
position, config) and rng.safetensors. No pickles: every file is safetensors or JSON.
checksums.json (doel/contracts/checksums.py) records every file's sha256, and a resume checks
them first: a damaged file is named in one line, never resumed from silently.

On one process and under DDP the optimizer is one file, optimizer.safetensors (the full state,
gathered to rank 0 under DDP). Under FSDP nothing but the HF-layout model is gathered: each rank
writes its shards of the model and optimizer to `sharded/` through torch.distributed.checkpoint
(DCP), whose HuggingFace storage writer makes one safetensors file a rank with the shards'
offsets in its header (DCP's default format pickles its `.metadata`). DCP's reader rebuilds the
layout from those headers, so the run resumes at any world size: under FSDP on another number
of ranks, or at one process without a process group. The model weights are then stored twice
(full and sharded), the price of a folder transformers can load that resumes without a gather.

A checkpoint is written to a hidden temporary folder and renamed into place, so a run killed
mid-save leaves the previous checkpoint whole; only the last `keep` are kept.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_state
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from doel.contracts import checksums
from doel.train.common import Damaged, DoelError, atomic_write_json
from doel.train.dist import full_model_state, full_state, is_sharded, load_full_state, unwrap
from doel.train.hf import WEIGHTS, load_model, read_config, read_safetensors, save_model

STEP_DIR = re.compile(r"^step-(\d{6,})$")
SHARDED = "sharded"  # the DCP shards of an FSDP run's model and optimizer


def flatten_optimizer(optim_sd: dict) -> tuple[dict, dict]:
    """A name-keyed optimizer state (from `get_state_dict`, full or sharded) as flat tensors
    (`state.<param name>.<key>`, kept where they are: a DTensor stays a shard) and a JSON-able
    rest (param groups, non-tensor values)."""
    tensors, scalars = {}, {}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{name}.{key}"] = value.detach()
            else:
                scalars[f"state.{name}.{key}"] = value
    return tensors, {"param_groups": optim_sd["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict, rest: dict) -> dict:
    state: dict[str, dict] = {}
    for flat, value in list(tensors.items()) + list(rest["scalars"].items()):
        name, key = flat.removeprefix("state.").rsplit(".", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda.{i}"] = s
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def save_checkpoint(
    run_dir, step: int, model, optimizer, trainer_state: dict, tokenizer=None, keep: int = 3
) -> Path:
    """Write `run_dir/checkpoints/step-NNNNNN` atomically and prune older ones. Under
    torch.distributed every rank must call it (each writes its shards under FSDP, and the
    full model is gathered); rank 0 writes the rest. A write that fails (a full disk) removes
    the partial folder and raises one line on every rank, naming the space needed and the
    checkpoint a resume will use."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    # One name on every rank (each writes its shards into it); a stale one is a killed save.
    tmp = root / f".tmp-step-{step:06d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    problem, error = None, None
    try:
        optim_sd, optim_rest = None, None
        if is_sharded(model):
            optim_rest = save_sharded(tmp / SHARDED, model, optimizer)
            model_sd = full_model_state(model)
        else:  # complete on rank 0 alone
            model_sd, optim_sd = full_state(model, optimizer)
        if _rank() == 0:
            _write(tmp, model, model_sd, (optim_sd, optim_rest), step, trainer_state, tokenizer)
            _publish(tmp, final, run_dir, keep)
    except (OSError, SafetensorError, CheckpointException) as e:
        error = e
        problem = _save_failed(e, root, tmp, step, model) if _rank() == 0 else str(e)
    problem = _agree(problem)  # rank 0's outcome, on every rank (the barrier of the save)
    if problem is not None:
        raise DoelError(problem) from None
    if error is not None:  # this rank alone failed: not seen by rank 0
        raise error
    return final


def _write(tmp: Path, model, model_sd, optim, step, trainer_state, tokenizer) -> None:
    """Rank 0's files of a checkpoint, checksums.json last. `optim`: the full optimizer state
    (one process, DDP) or None, and the non-tensor rest when DCP wrote the tensors (FSDP)."""
    optim_sd, optim_rest = optim
    save_model(unwrap(model), tmp, tokenizer=tokenizer, state_dict=model_sd)
    if optim_sd is not None:
        tensors, optim_rest = flatten_optimizer(optim_sd)
        tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
        save_file(tensors, str(tmp / "optimizer.safetensors"))
    save_file(rng_state(), str(tmp / "rng.safetensors"))
    meta = {"step": step, "saved_at": time.time(), "optimizer": optim_rest}
    atomic_write_json(tmp / "trainer_state.json", {**meta, **trainer_state})
    atomic_write_json(tmp / checksums.NAME, checksums.record(tmp))  # the sharded/ files too


def _save_failed(e: Exception, root: Path, tmp: Path, step: int, model) -> str:
    """Remove the partial folder; the one line that says what failed, what is kept and, for a
    full disk, the space a checkpoint needs (the last one's size, else ~3x the parameters:
    weights and two optimizer moments)."""
    shutil.rmtree(tmp, ignore_errors=True)
    last = latest_checkpoint(root.parent)
    resume = (
        f"a resume will use {last}, the last whole checkpoint"
        if last
        else "no checkpoint was written before it: a rerun starts over"
    )
    text = " ".join(str(e).split())
    if not (getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text):
        return f"writing the checkpoint of step {step} to {tmp} failed ({text[:200]}); {resume}"
    if last is not None:
        need = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    else:
        need = 3 * sum(p.numel() * p.element_size() for p in unwrap(model).parameters())
    free = shutil.disk_usage(root).free
    return (
        f"no space left on the device of {root} for the checkpoint of step {step}: it needs "
        f"about {need / 1e6:,.1f} MB, {free / 1e6:,.1f} MB are free; the partial {tmp.name} was "
        f"removed and {resume}: free space and run the same command again"
    )


def _agree(problem: str | None) -> str | None:
    """Rank 0's `problem` on every rank (it alone writes most of a checkpoint)."""
    if not dist.is_initialized():
        return problem
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _publish(tmp: Path, final: Path, run_dir, keep: int) -> None:
    """Rename the finished folder into place (durably) and prune all but the last `keep`."""
    _fsync_dir(tmp)
    if final.exists():  # a re-run that reached the same step: replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _dcp_state(model, optimizer) -> tuple[dict, dict]:
    """What DCP writes and reads: this rank's model and optimizer tensors (DTensor shards under
    FSDP, whole tensors on one process), a tied parameter once (safetensors refuses two names
    for one storage); and the optimizer's non-tensor rest."""
    # (a fresh optimizer's state is made here)
    model_sd, optim_sd = dcp_state.get_state_dict(model, optimizer)
    for _, dropped in unwrap(model).tied_parameters:
        model_sd.pop(dropped, None)
    tensors, rest = flatten_optimizer(optim_sd)
    return {"model": model_sd, "optim": tensors}, rest


def save_sharded(folder: Path, model, optimizer) -> dict:
    """Each rank writes its shards to `folder` (one safetensors file a rank); every rank calls
    it. Returns the optimizer's non-tensor rest, for trainer_state.json."""
    state, rest = _dcp_state(model, optimizer)
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(folder), save_distributed=True))
    return rest


def load_sharded(folder: Path, model, optimizer, rest: dict) -> None:
    """Read the shards in `folder` into `model` and `optimizer`, resharded to this run's world
    size (one process: no process group needed)."""
    state, _ = _dcp_state(model, optimizer)
    reader = dcp.HuggingFaceStorageReader(str(folder))
    dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())  # in place
    model_sd = state["model"]
    for kept, dropped in unwrap(model).tied_parameters:
        model_sd[dropped] = model_sd[kept]
    optim_sd = unflatten_optimizer(state["optim"], rest)
    dcp_state.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover (platforms without directory fds)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders of an interrupted save are
    ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _damaged_hint(folder: Path) -> str:
    return f"delete {folder} and run again to resume from the checkpoint before it, if any"


def load_checkpoint(folder, model=None, optimizer=None, device="cpu", verify=True):
    """Load a checkpoint into `model` (built from its config.json if None) and `optimizer`,
    plain or wrapped by DDP/FSDP at any world size; restore the RNG state. Returns
    (model, trainer_state). `verify`: first check its files against checksums.json (a
    checkpoint written before doel recorded hashes has none to check)."""
    folder = Path(folder)
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        raise DoelError(f"{folder} is not a training checkpoint (no trainer_state.json)")
    if verify:
        hint = f"{_damaged_hint(folder)}; or pass --no-checksums to resume from it as it is"
        checksums.verify(folder, Damaged, hint=hint)
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DoelError(f"{state_path} cannot be read ({e}); {_damaged_hint(folder)}") from None
    if model is None:
        model = load_model(folder, device=device)
    inner = unwrap(model)
    if read_config(folder) != inner.config:
        raise DoelError(
            f"{folder} holds a model with a different config than this run's; resume with "
            "the same [model] settings or start afresh"
        )
    if optimizer is None:  # the model alone: the HF-layout weights, whatever the layout
        model_sd = read_safetensors(folder / WEIGHTS, hint=_damaged_hint(folder))
        for kept, dropped in inner.tied_parameters:
            model_sd[dropped] = model_sd[kept]
        inner.load_state_dict(model_sd, strict=False)
    else:
        _load_training_state(folder, model, optimizer, state)
    set_rng_state(read_safetensors(folder / "rng.safetensors", hint=_damaged_hint(folder)))
    return model, state


def _load_training_state(folder: Path, model, optimizer, state: dict) -> None:
    """Model and optimizer from the shards (an FSDP checkpoint) or the full files."""
    rest = state["optimizer"]
    if "param_groups" not in rest or "scalars" not in rest:
        raise DoelError(f"{folder}: optimizer state in an unknown layout")
    if (folder / SHARDED).is_dir():
        load_sharded(folder / SHARDED, model, optimizer, rest)
        return
    if not (folder / "optimizer.safetensors").is_file():
        raise DoelError(
            f"{folder}: neither optimizer.safetensors nor {SHARDED}/ is there; the checkpoint "
            "is incomplete: delete it to resume from the one before"
        )
    hint = _damaged_hint(folder)
    model_sd = read_safetensors(folder / WEIGHTS, hint=hint)
    for kept, dropped in unwrap(model).tied_parameters:
        model_sd[dropped] = model_sd[kept]
    optim_sd = unflatten_optimizer(
        read_safetensors(folder / "optimizer.safetensors", hint=hint), rest
    )
    load_full_state(model, optimizer, model_sd, optim_sd)
