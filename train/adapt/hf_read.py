"""A Hugging Face Llama folder read for an import: config.json held to Llama's shape (shape.py),
the safetensors weights (one file, or the shards an index names) with each header's framing and
each tensor's shape checked before a tensor is read, and the tokenizer files as they are: the
import keeps the model's own tokenizer.json, tokenizer_config.json and chat template (inline, in
chat_template.jinja as transformers 4.43+ saves it, or chat_template.json).

The folder is a stranger's: every size it claims is bounded (doel.contracts.untrusted), every
file name it gives is a name in the folder, and no file it makes doel read may be a link out of
it. Pickled weights (.bin, .pt) are never loaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from doel.contracts import untrusted
from doel.train.adapt.shape import Refused, Source, check_shapes, model_config
from doel.train.hf import read_safetensors, safetensors_problem

INDEX = "model.safetensors.index.json"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
DROPPED = ("chat_template", "auto_map")  # the template is written apart; auto_map names code


def _file(folder: Path, name: str, field: str) -> Path:
    """folder/name, where name is a plain file name and the file does not lead out."""
    path = folder / untrusted.plain_name(name, field)
    untrusted.inside(folder, path, field)
    return path


def _record(folder: Path, name: str, required: bool = False) -> dict | None:
    path = _file(folder, name, name)
    if not path.is_file():
        if required:
            raise Refused(f"{folder}: no {name}; expected a Hugging Face model folder")
        return None
    try:
        data = untrusted.read_record(path)
    except untrusted.UntrustedError:
        raise
    except (OSError, ValueError) as e:
        raise Refused(f"{path}: not JSON ({e}); {untrusted.AGAIN}") from None
    if not isinstance(data, dict):
        raise Refused(f"{path}: not a JSON object; {untrusted.AGAIN}")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The files holding the weights: the shards an index names, else model.safetensors."""
    index = _record(folder, INDEX)
    if index is not None:
        names = index.get("weight_map")
        if not isinstance(names, dict):
            raise Refused(f"{folder / INDEX}: no weight_map; {untrusted.AGAIN}")
        files = [_file(folder, n, f"{INDEX} weight_map") for n in sorted(set(names.values()))]
    else:
        files = [_file(folder, "model.safetensors", "model.safetensors")]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        pickled = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
        why = ", only pickled weights (.bin/.pt), which doel never loads" if pickled else ""
        raise Refused(
            f"{folder}: no {missing[0]}{why}; save the model with safetensors "
            "(`save_pretrained(..., safe_serialization=True)`)"
        )
    return files


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    untrusted.whole(n, f"{path.name} header length", untrusted.MAX_SAFETENSORS_HEADER_BYTES)
    problem = safetensors_problem(path)
    if problem is not None:
        raise Refused(f"{path} is truncated or damaged ({problem}); copy it again")
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _weights(folder: Path, cfg) -> dict[str, torch.Tensor]:
    files = weight_files(folder)
    shapes = {}
    for path in files:
        shapes.update(_shapes(path))
    check_shapes(shapes, cfg, f"{folder.name}'s weights")
    tensors = {}
    for path in files:
        tensors.update(read_safetensors(path))
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        if not torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"]):
            raise Refused(
                f"{folder.name}: config.json ties the head to the embedding, but lm_head.weight "
                "differs from it; doel imports Llama models only (train/model.py)"
            )
    return tensors


def chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """The template in tokenizer_config.json, else in chat_template.jinja / .json."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and _file(folder, TEMPLATE_FILES[0], TEMPLATE_FILES[0]).is_file():
        path = folder / TEMPLATE_FILES[0]
        untrusted.file_bytes(path, untrusted.MAX_RECORD_BYTES)
        template = path.read_text(encoding="utf-8")
    if template is None:
        template = (_record(folder, TEMPLATE_FILES[1]) or {}).get("chat_template")
    if template is not None and not isinstance(template, str):
        raise Refused(f"{folder}: its chat template is not text; {untrusted.AGAIN}")
    return template


def card_license(folder: Path) -> str | None:
    """The `license:` of the folder's README.md metadata block (a Hub model card), if any."""
    path = folder / "README.md"
    if not path.is_file() or path.is_symlink() or path.stat().st_size > untrusted.MAX_RECORD_BYTES:
        return None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            return None
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return value.strip().strip("'\"")[:64]
    return None


def read_folder(folder: Path) -> Source:
    """What an import writes from a Hugging Face folder, checked; Refused naming a problem."""
    config = _record(folder, "config.json", required=True)
    cfg = model_config(config, f"{folder.name}/config.json")
    tok_path = _file(folder, "tokenizer.json", "tokenizer.json")
    if not tok_path.is_file():
        raise Refused(
            f"{folder}: no tokenizer.json; save the model's fast tokenizer beside it "
            "(`AutoTokenizer.from_pretrained(...).save_pretrained(folder)`)"
        )
    tok = untrusted.check_tokenizer(tok_path)
    if tok is None:
        raise Refused(f"{tok_path}: not a tokenizer.json; {untrusted.AGAIN}")
    tok_config = _record(folder, "tokenizer_config.json") or {}
    generation = _record(folder, "generation_config.json") or {}
    return Source(
        config=cfg,
        tensors=_weights(folder, cfg),
        tokenizer=tok,
        tokenizer_config={k: v for k, v in tok_config.items() if k not in DROPPED},
        chat_template=chat_template(folder, tok_config),
        generation=generation,
        source={
            "kind": "huggingface",
            "name": folder.resolve().name,
            "license": card_license(folder),
            "eos_token_id": config.get("eos_token_id"),
        },
        special={
            k: tok_config[k].get("content") if isinstance(tok_config[k], dict) else tok_config[k]
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if tok_config.get(k) is not None
        },
    )
