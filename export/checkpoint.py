"""Read and check the checkpoint folder before any work: Hugging Face layout, safetensors weights,
a causal-LM architecture, and a tokenizer whose ids fit the model's vocabulary.

Every refusal says what is wrong and what to pass instead; nothing is written before these checks
pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from export.common import ExportError, sha256_file

# What `doel-train fit` writes; any Hugging Face folder with these files works too.
HF_HINT = (
    "expected a model folder in Hugging Face layout (config.json + model.safetensors), such as "
    "RUN/final written by `doel-train fit` or a folder written by `save_pretrained`"
)


@dataclass(frozen=True)
class Checkpoint:
    """What the export needs to know about the source folder."""

    folder: Path
    config: dict
    architecture: str
    model_type: str
    vocab_size: int
    context_length: int
    kv_heads: int
    head_dim: int
    tokenizer: Path
    tokenizer_vocab_size: int
    special_tokens: dict
    config_sha256: str
    weights: tuple[Path, ...]


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder; {HF_HINT}")
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"{folder} has no config.json; {HF_HINT}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); {HF_HINT}") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise ExportError(f"{path} names no architectures; {HF_HINT}")
    return config


def _weights(folder: Path) -> tuple[Path, ...]:
    found = tuple(sorted(folder.glob("*.safetensors")))
    if found:
        return found
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ExportError(
            f"{folder} holds only pickled weights (.bin/.pt), which doel never loads; save the "
            "model with safetensors (`save_pretrained(..., safe_serialization=True)`)"
        )
    raise ExportError(f"{folder} has no *.safetensors weights; {HF_HINT}")


def _first(config: dict, *keys: str):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def _shape(config: dict) -> tuple[int, int, int, int]:
    """(vocabulary, context length, KV heads, head dim) under Llama's or GPT-2's key names."""
    vocab = _first(config, "vocab_size")
    context = _first(config, "max_position_embeddings", "n_positions", "n_ctx")
    heads = _first(config, "num_attention_heads", "n_head")
    hidden = _first(config, "hidden_size", "n_embd")
    if not all(isinstance(v, int) and v > 0 for v in (vocab, context, heads, hidden)):
        raise ExportError(
            "config.json lacks a positive vocab_size, context length (max_position_embeddings), "
            f"number of heads or hidden size; {HF_HINT}"
        )
    kv_heads = _first(config, "num_key_value_heads") or heads
    head_dim = _first(config, "head_dim") or hidden // heads
    return vocab, context, kv_heads, head_dim


def _tokenizer_info(path: Path, config: dict, vocab: int) -> tuple[int, dict]:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises bare Exceptions on bad files
        raise ExportError(f"{path} is not a tokenizers tokenizer.json ({e})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise ExportError(
            f"the tokenizer {path} has {size} tokens but the model's vocab_size is {vocab}: ids "
            f"≥ {vocab} would index past the embedding table; pass the tokenizer the model was "
            "trained with (--tokenizer PATH)"
        )
    special = {}
    for role in ("bos", "eos", "pad"):
        tid = config.get(f"{role}_token_id")
        if isinstance(tid, int):
            token = tok.id_to_token(tid)
            if token is None:
                raise ExportError(
                    f"config.json {role}_token_id={tid} is not a token of {path} "
                    f"({size} tokens); pass the tokenizer the model was trained with"
                )
            special[role] = {"id": tid, "token": token}
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return size, {**special, "added": added}


def inspect_checkpoint(folder: str | Path, tokenizer: str | Path | None = None) -> Checkpoint:
    """Check the folder and its tokenizer; raise ExportError naming the problem."""
    folder = Path(folder)
    config = _read_config(folder)
    weights = _weights(folder)
    vocab, context, kv_heads, head_dim = _shape(config)
    tok = Path(tokenizer) if tokenizer else folder / "tokenizer.json"
    if tok.is_dir():
        tok = tok / "tokenizer.json"
    if not tok.is_file():
        raise ExportError(
            f"no tokenizer at {tok}: the bundle must carry the model's tokenizer.json; put it in "
            "the checkpoint folder or pass --tokenizer PATH"
        )
    tok_size, special = _tokenizer_info(tok, config, vocab)
    return Checkpoint(
        folder=folder,
        config=config,
        architecture=config["architectures"][0],
        model_type=str(config.get("model_type", "")),
        vocab_size=vocab,
        context_length=context,
        kv_heads=kv_heads,
        head_dim=head_dim,
        tokenizer=tok,
        tokenizer_vocab_size=tok_size,
        special_tokens=special,
        config_sha256=sha256_file(folder / "config.json"),
        weights=weights,
    )
