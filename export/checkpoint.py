"""Read and check the checkpoint folder before any work: Hugging Face layout, safetensors weights
whose headers parse and whose sizes match the files' lengths (a truncated copy is refused at
once, naming the file), a causal-LM architecture, and a tokenizer whose ids fit the model's
vocabulary. A folder that records its files' hashes (checksums.json: a checkpoint or RUN/final
that `doel-train` wrote) has the files the export reads checked against them: damaged weights are
refused, naming the file, instead of being exported and then matched by parity against
themselves.

Every refusal says what is wrong and what to pass instead; nothing is written before these checks
pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from doel.contracts import checksums
from doel.export.common import ExportError, sha256_file

# What `doel-train fit` writes; any Hugging Face folder with these files works too.
HF_HINT = (
    "expected a model folder in Hugging Face layout (config.json + model.safetensors), such as "
    "RUN/final written by `doel-train fit` or a folder written by `save_pretrained`"
)

# Bytes per element of the safetensors dtypes a language model's weights use; a dtype not listed
# (sub-byte ones) is checked only through the file's total length.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


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


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise ExportError(f"{folder} is not a folder; {HF_HINT}")
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"{folder} has no config.json; {HF_HINT}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ExportError(f"cannot read {path} ({e.strerror}); {HF_HINT}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); {HF_HINT}") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise ExportError(f"{path} names no architectures; {HF_HINT}")
    return config


def _safetensors_header(path: Path, size: int) -> tuple[int, dict]:
    """(header length, {tensor: entry}) of a safetensors file; ValueError when unreadable."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise ValueError("no room for the header")
        header = json.loads(f.read(n))  # its errors are ValueErrors
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return n, {k: v for k, v in header.items() if k != "__metadata__"}


def _span(entry: dict) -> tuple[int, int, int]:
    """(begin, end, bytes its shape and dtype need; 0 for a dtype not in DTYPE_BYTES)."""
    begin, end = (int(x) for x in entry["data_offsets"])
    return (
        begin,
        end,
        math.prod(int(d) for d in entry["shape"]) * DTYPE_BYTES.get(entry["dtype"], 0),
    )


def _check_safetensors(path: Path) -> None:
    """Parse the header and compare the sizes it states with the file's length: a truncated or
    damaged file is refused here, in a second, not deep inside a graph builder minutes later."""
    again = "copy it again or save the checkpoint again"
    size = path.stat().st_size
    try:
        n, tensors = _safetensors_header(path, size)
        spans = {name: _span(t) for name, t in tensors.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ExportError(
            f"{path} is truncated or not a safetensors file (no readable header in its {size} "
            f"bytes); {again}"
        ) from None
    for name, (begin, stop, need) in spans.items():
        if stop < begin or (need and stop - begin != need):
            raise ExportError(
                f"{path} is damaged: tensor {name!r} takes {stop - begin} bytes where its shape "
                f"and dtype need {need}; {again}"
            )
    end = max((stop for _, stop, _ in spans.values()), default=0)
    if 8 + n + end != size:
        raise ExportError(
            f"{path} is truncated or damaged: its header describes {8 + n + end} bytes, the file "
            f"has {size}; {again}"
        )


def _check_shards(folder: Path) -> list[str]:
    """The weights files a sharded checkpoint's index names (none without an index); each must
    be there."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ExportError(f"{index} is not JSON with a weight_map; copy it again") from None
    missing = sorted(str(n) for n in names if not (folder / str(n)).is_file())
    if missing:
        raise ExportError(
            f"{folder} lacks {', '.join(missing)}, named in {index.name}; copy the whole folder"
        )
    return sorted(str(n) for n in names)


def _weights(folder: Path) -> tuple[Path, ...]:
    """The model's weights files, checked: those a sharded index names, else model.safetensors,
    else every *.safetensors (a training checkpoint's optimizer and RNG files are not the
    model's, and are neither read nor hashed)."""
    found = tuple(sorted(folder.glob("*.safetensors")))
    if found:
        names = _check_shards(folder) or ["model.safetensors"]
        model = tuple(p for p in found if p.name in names) or found
        for path in model:
            _check_safetensors(path)
        return model
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
    hashes = _verified(folder, weights, tok) if verify else {}
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
        config_sha256=hashes.get("config.json") or sha256_file(folder / "config.json"),
        weights=weights,
        hashes=hashes,
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
