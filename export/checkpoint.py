"""Read and check the checkpoint folder before any work: Hugging Face layout, safetensors weights
whose headers parse and whose sizes match the files' lengths (a truncated copy is refused at
once, naming the file), a causal-LM architecture, and a tokenizer whose ids fit the model's
vocabulary. A folder that records its files' hashes (checksums.json: a checkpoint or RUN/final
that `doel-train` wrote) has the files the export reads checked against them: damaged weights are
refused, naming the file, instead of being exported and then matched by parity against
themselves.

The folder may be a stranger's (a download): every size it claims is held to the bounds of
doel.contracts.untrusted, and config.json's shape to the tensors the safetensors headers hold
(export/claims.py), before anything is read whole or allocated by it; tokenizer.json's counts and
pipeline are bounded before the tokenizers library builds it.

Every refusal says what is wrong and what to pass instead; nothing is written before these checks
pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from doel.contracts import checksums, read_json, untrusted
from doel.export import chat
from doel.export.claims import check_claims
from doel.export.common import ExportError, sha256_file
from doel.export.headers import check_safetensors

# What `doel-train fit` writes; any Hugging Face folder with these files works too.
HF_HINT = (
    "expected a model folder in Hugging Face layout (config.json + model.safetensors), such as "
    "RUN/final written by `doel-train fit` or a folder written by `save_pretrained`"
)

# Files beside the weights that the export reads whole (bundle.py, modelfile.py, card.py).
SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "model_card.json",
    "chat_template.jinja",
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
    hashes: dict = field(default_factory=dict)  # {file name: sha256} checked against the record
    chat_template: str | None = None  # the tokenizer's own (export/chat.py)


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder; {HF_HINT}")
    path = folder / "config.json"
    if not path.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if ggufs:  # never opened: doel reads no GGUF
            raise ExportError(
                f"{folder} holds a GGUF ({ggufs[0].name}), which doel-export does not read; "
                "export the Hugging Face folder it was made from"
            )
        raise ExportError(f"{folder} has no config.json; {HF_HINT}")
    try:
        config = untrusted.read_record(path)
    except untrusted.UntrustedError:
        raise
    except OSError as e:
        raise ExportError(f"cannot read {path} ({e.strerror}); {HF_HINT}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); {HF_HINT}") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise ExportError(f"{path} names no architectures; {HF_HINT}")
    untrusted.sizes(config, untrusted.CONFIG_BOUNDS, "config.json")
    return config


def _check_shards(folder: Path) -> list[str]:
    """The weights files a sharded checkpoint's index names (none without an index); each must
    be there."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        names = set(untrusted.read_record(index)["weight_map"].values())
    except untrusted.UntrustedError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ExportError(f"{index} is not JSON with a weight_map; copy it again") from None
    for name in names:  # a name, not a path: "../x" or "/x" would read outside the folder
        untrusted.plain_name(name, f"{index} weight_map")
    missing = sorted(str(n) for n in names if not (folder / str(n)).is_file())
    if missing:
        raise ExportError(
            f"{folder} lacks {', '.join(missing)}, named in {index.name}; copy the whole folder"
        )
    return sorted(str(n) for n in names)


def _weights(folder: Path) -> tuple[tuple[Path, ...], dict[str, tuple[int, ...]]]:
    """The model's weights files, checked, and the shapes of their tensors: the files a sharded
    index names, else model.safetensors, else every *.safetensors (a training checkpoint's
    optimizer and RNG files are not the model's, and are neither read nor hashed)."""
    found = tuple(sorted(folder.glob("*.safetensors")))
    if found:
        names = _check_shards(folder) or ["model.safetensors"]
        model = tuple(p for p in found if p.name in names) or found
        shapes: dict[str, tuple[int, ...]] = {}
        for path in model:
            shapes.update(check_safetensors(path))
        return model, shapes
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
    if heads % kv_heads:
        raise ExportError(
            f"config.json num_key_value_heads={kv_heads} does not divide num_attention_heads="
            f"{heads}; {untrusted.AGAIN}"
        )
    return vocab, context, kv_heads, head_dim


def _tokenizer_info(path: Path, config: dict, vocab: int) -> tuple[int, dict]:
    from tokenizers import Tokenizer

    untrusted.check_tokenizer(path)  # its counts and pipeline bounded before tokenizers builds it
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


def _verified(folder: Path, weights: tuple[Path, ...], tokenizer: Path) -> dict[str, str]:
    """The files the export reads, checked against the folder's checksums.json where it has
    one: {name: sha256} of those checked."""
    names = ["config.json", *(p.name for p in weights)]
    if tokenizer.parent.resolve() == folder.resolve():
        names.append(tokenizer.name)
    hint = (
        "copy it again or export another checkpoint; or pass --no-checksums to export it as it is"
    )
    return checksums.verify(folder, ExportError, names=names, hint=hint)


def inspect_checkpoint(
    folder: str | Path, tokenizer: str | Path | None = None, verify: bool = True
) -> Checkpoint:
    """Check the folder and its tokenizer; raise ExportError naming the problem. `verify`: the
    files read checked against the folder's recorded hashes, where it records them."""
    try:
        return _inspect(Path(folder), tokenizer, verify)
    except untrusted.UntrustedError as e:
        raise ExportError(str(e)) from None


def _inspect(folder: Path, tokenizer: str | Path | None, verify: bool) -> Checkpoint:
    config = _read_config(folder)
    weights, shapes = _weights(folder)
    vocab, context, kv_heads, head_dim = _shape(config)
    tok = Path(tokenizer) if tokenizer else folder / "tokenizer.json"
    if tok.is_dir():
        tok = tok / "tokenizer.json"
    if not tok.is_file():
        raise ExportError(
            f"no tokenizer at {tok}: the bundle must carry the model's tokenizer.json; put it in "
            "the checkpoint folder or pass --tokenizer PATH"
        )
    for side in {folder, tok.parent}:
        for name in SIDE_FILES:
            if (side / name).is_file():
                untrusted.file_bytes(side / name, untrusted.MAX_RECORD_BYTES)
    hashes = _verified(folder, weights, tok) if verify else {}
    tok_size, special = _tokenizer_info(tok, config, vocab)
    template = chat.read_template(tok.parent)
    tok_config = read_json(tok.parent / "tokenizer_config.json") or {}
    end = chat.end_of_turn(template, tok_config, list(special["added"]))
    if end is not None:  # a stop token of the model's own, beside its EOS
        special["end_of_turn"] = {"id": special["added"][end], "token": end}
    check_claims(config, shapes, head_dim)  # before anything is built by config.json's sizes
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
        config_sha256=hashes.get("config.json") or sha256_file(folder / "config.json"),
        weights=weights,
        hashes=hashes,
        chat_template=template,
    )


def source_record(ckpt: Checkpoint) -> dict:
    """Which checkpoint a bundle came from, without where it lay on the machine that exported it
    (an absolute path tells every reader of the bundle the exporter's user and folder layout):
    the folder's name, and hashes that identify its config and weights anywhere."""
    cfg = ckpt.config
    return {
        "folder": ckpt.folder.resolve().name,
        "config_sha256": ckpt.config_sha256,
        "weights": {
            p.name: {"bytes": p.stat().st_size, "sha256": ckpt.hashes.get(p.name) or sha256_file(p)}
            for p in ckpt.weights
        },
        "num_hidden_layers": cfg.get("num_hidden_layers", cfg.get("n_layer")),
        "hidden_size": cfg.get("hidden_size", cfg.get("n_embd")),
    }
