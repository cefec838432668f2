"""Model folders in Hugging Face layout: `config.json`, `model.safetensors`, `tokenizer.json` with
`tokenizer_config.json` and `special_tokens_map.json`, `generation_config.json`.
`transformers.LlamaForCausalLM.from_pretrained(folder)` loads what `save_model` writes, and
`load_model` reads what transformers' `save_pretrained` writes.

A tied head is stored once (as `model.embed_tokens.weight`), as transformers does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from doel.train.common import DoelError, atomic_write_json
from doel.train.data.tokenizer import write_hf_side_files
from doel.train.model import Llama, ModelConfig

WEIGHTS = "model.safetensors"


def generation_config(cfg: ModelConfig) -> dict:
    return {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 50,
        # No max_length: with one, a plain generate() runs to the end of the context, and some
        # transformers versions warn when max_new_tokens is given beside it (config.json has
        # the context length).
    }


def state_dict_for_save(model: Llama, state_dict=None) -> dict[str, torch.Tensor]:
    sd = model.state_dict() if state_dict is None else state_dict
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    for _, dropped in model.tied_parameters:
        sd.pop(dropped, None)
    return sd


def save_model(
    model: Llama,
    folder: str | Path,
    tokenizer: str | Path | None = None,
    extra_json: dict[str, dict] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the HF-layout folder (not atomically: callers that need that write to a temporary
    folder and rename it, as `train/checkpoint.py` does). `state_dict` replaces the model's own
    (a full state gathered from FSDP shards)."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        state_dict_for_save(model, state_dict), str(folder / WEIGHTS), metadata={"format": "pt"}
    )
    atomic_write_json(folder / "config.json", model.config.to_hf())
    atomic_write_json(folder / "generation_config.json", generation_config(model.config))
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        src_dir = tokenizer.parent if tokenizer.is_file() else tokenizer
        if (src_dir / "tokenizer.json").is_file():
            shutil.copyfile(src_dir / "tokenizer.json", folder / "tokenizer.json")
            # Written afresh rather than copied, so that a tokenizer trained before a field was
            # added (model_input_names) still gives every checkpoint complete side files.
            write_hf_side_files(folder)
    for name, obj in (extra_json or {}).items():
        atomic_write_json(folder / name, obj)
    return folder


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors file's framing, or None: 8 bytes giving the length of
    a JSON header, then exactly the bytes the header's tensor offsets cover. Checked before
    loading so that a truncated copy is named with its sizes rather than failing in the
    library with an error that names no file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"its header claims {n:,} bytes but the file has {size:,} in all"
        try:
            header = json.loads(f.read(n))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not safetensors JSON"
    need = 8 + n + max(ends, default=0)
    if need != size:
        return f"its tensors need {need:,} bytes but the file has {size:,}"
    return None


def read_safetensors(path: str | Path, device="cpu", hint: str = "") -> dict[str, torch.Tensor]:
    """`load_file`, with a truncated or damaged file refused in one line that names it (and
    says `hint`, what to do, when given)."""
    path = Path(path)
    try:
        problem = safetensors_problem(path)
        if problem is None:
            return load_file(str(path), device=str(device))
    except (OSError, SafetensorError) as e:
        problem = " ".join(str(e).split())[:200]
    raise DoelError(f"{path} is truncated or damaged ({problem}); {hint or 'copy it again'}")


def read_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise DoelError(f"{folder}: no config.json; expected a model folder in Hugging Face layout")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text(encoding="utf-8")))
    except OSError as e:
        raise DoelError(f"{path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, UTF-8 or a Llama config
        raise DoelError(f"{path}: {e}") from None


def load_model(folder: str | Path, device: str | torch.device = "cpu") -> Llama:
    """Build the model from `config.json` and load `model.safetensors` strictly: a missing or
    unexpected tensor is an error, never a silently random weight."""

    folder = Path(folder)
    cfg = read_config(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise DoelError(f"{folder}: no {WEIGHTS} (sharded or .bin checkpoints are not supported)")
    sd = read_safetensors(weights, device)
    with torch.device(device):
        model = Llama(cfg)
    expected = set(model.state_dict()) - {b for _, b in model.tied_parameters}
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if cfg.tie_word_embeddings and "lm_head.weight" in unexpected:
        # Some writers store the tied head too; accept it only if it equals the embedding.
        if not torch.equal(sd.pop("lm_head.weight"), sd["model.embed_tokens.weight"]):
            raise DoelError(f"{weights}: tie_word_embeddings is set but lm_head differs")
        unexpected.remove("lm_head.weight")
    if missing or unexpected:
        raise DoelError(f"{weights}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(sd, strict=False)
    return model
