"""Training checkpoints: a Hugging Face model folder plus everything needed to resume exactly.

`RUN_DIR/checkpoints/step-000200/` holds config.json, model.safetensors, tokenizer.json,
generation_config.json (loadable by transformers as is) and, for resuming, optimizer.safetensors
(the optimizer's tensors), trainer_state.json (step, optimizer hyper-parameters, loader position,
config) and rng.safetensors. No pickles: every file is safetensors or JSON.

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

from train.common import DoelError, atomic_write_json
from train.hf import load_model, save_model

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Split an optimizer state dict into tensors (for safetensors) and JSON-able rest."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(optimizer, tensors: dict, rest: dict) -> None:
    state: dict[int, dict] = {}
    for flat, value in list(tensors.items()) + list(rest["scalars"].items()):
        idx, key = flat.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": rest["param_groups"]})


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
    """Write `run_dir/checkpoints/step-NNNNNN` atomically and prune older ones."""
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp, tokenizer=tokenizer)
    tensors, rest = _optimizer_tensors(optimizer)
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
    return final


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
    """Read a checkpoint folder. Loads the weights into `model` (or builds one), restores the
    optimizer and RNG state if given, and returns (model, trainer_state)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        raise DoelError(f"{folder} is not a training checkpoint (no trainer_state.json)")
    state = json.loads(state_path.read_text(encoding="utf-8"))
    loaded = load_model(folder, device=device)
    if model is None:
        model = loaded
    else:
        if loaded.config != model.config:
            raise DoelError(
                f"{folder} holds a model with a different config than this run's; resume with "
                "the same [model] settings or start afresh"
            )
        with torch.no_grad():
            for name, p in model.state_dict().items():
                p.copy_(loaded.state_dict()[name])
    if optimizer is not None:
        # On CPU: load_state_dict moves each state to its parameter's device as the optimizer wants.
        tensors = load_file(str(folder / "optimizer.safetensors"))
        _restore_optimizer(optimizer, tensors, state["optimizer"])
    set_rng_state(load_file(str(folder / "rng.safetensors")))
    return model, state
