"""Training checkpoints: a Hugging Face model folder plus everything needed to resume exactly.

`RUN_DIR/checkpoints/step-000200/` holds config.json, model.safetensors, tokenizer.json,
generation_config.json (loadable by transformers as is) and, for resuming, optimizer.safetensors
(the optimizer's tensors, keyed by parameter name), trainer_state.json (step, optimizer
hyper-parameters, loader position, config) and rng.safetensors. No pickles: every file is
safetensors or JSON. The state is always the full one (gathered under FSDP), so a checkpoint
resumes at any world size.

A checkpoint is written to a hidden temporary folder and renamed into place, so a run killed
mid-save leaves the previous checkpoint whole; only the last `keep` are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from train.common import DoelError, atomic_write_json
from train.dist import full_state, load_full_state
from train.gradflow import unwrap
from train.hf import WEIGHTS, load_model, read_config, save_model

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def flatten_optimizer(optim_sd: dict) -> tuple[dict, dict]:
    """A name-keyed optimizer state (from `dist.full_state`) as safetensors tensors
    (`state.<param name>.<key>`) and a JSON-able rest (param groups, non-tensor values)."""
    tensors, scalars = {}, {}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{name}.{key}"] = value.detach().cpu().contiguous()
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
    torch.distributed every rank must call it (the state is gathered); rank 0 writes."""
    from safetensors.torch import save_file

    model_sd, optim_sd = full_state(model, optimizer)
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(unwrap(model), tmp, tokenizer=tokenizer, state_dict=model_sd)
        tensors, rest = flatten_optimizer(optim_sd)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        save_file(rng_state(), str(tmp / "rng.safetensors"))
        atomic_write_json(
            tmp / "trainer_state.json",
            {
                "step": step,
                "saved_at": time.time(),
                "optimizer": rest,
                **trainer_state,
            },
        )
        _fsync_dir(tmp)
        if final.exists():  # a re-run that reached the same step: replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


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


def load_checkpoint(folder, model=None, optimizer=None, device="cpu"):
    """Load a checkpoint into `model` (built from its config.json if None) and `optimizer`,
    plain or wrapped by DDP/FSDP at any world size; restore the RNG state. Returns
    (model, trainer_state)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        raise DoelError(f"{folder} is not a training checkpoint (no trainer_state.json)")
    state = json.loads(state_path.read_text(encoding="utf-8"))
    if model is None:
        model = load_model(folder, device=device)
    inner = unwrap(model)
    if read_config(folder) != inner.config:
        raise DoelError(
            f"{folder} holds a model with a different config than this run's; resume with "
            "the same [model] settings or start afresh"
        )
    model_sd = load_file(str(folder / WEIGHTS))
    for kept, dropped in inner.tied_parameters:
        model_sd[dropped] = model_sd[kept]
    optim_sd = None
    if optimizer is not None:
        rest = state["optimizer"]
        if "param_groups" not in rest or "scalars" not in rest:
            raise DoelError(f"{folder}: optimizer state in an unknown layout")
        optim_sd = unflatten_optimizer(load_file(str(folder / "optimizer.safetensors")), rest)
    if optim_sd is None:
        inner.load_state_dict(model_sd, strict=False)
    else:
        load_full_state(model, optimizer, model_sd, optim_sd)
    set_rng_state(load_file(str(folder / "rng.safetensors")))
    return model, state
