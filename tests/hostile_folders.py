"""Hostile model folders, one function each, as a stranger could publish them for doel-export
(a Hugging Face folder) or doel-serve (a bundle): small files whose claims are absurd (issue 48,
4). Each starts from a folder doel takes (`checkpoint`, `bundle`) and changes one thing; the
tests (tests/cross/test_untrusted_folders.py) assert that the reader refuses it in one line
naming the field, and that the refusal stays small in memory.

No torch and no training: the weights are zeros in a safetensors file written here, the
tokenizer a three-token BPE, the bundle's graph an empty file (read_bundle refuses before it
would be opened)."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

# A Llama small enough to write by hand: its config.json and the shapes its tensors have.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
LAYER = {
    "input_layernorm.weight": [16],
    "self_attn.q_proj.weight": [16, 16],
    "self_attn.k_proj.weight": [8, 16],
    "self_attn.v_proj.weight": [8, 16],
    "self_attn.o_proj.weight": [16, 16],
    "post_attention_layernorm.weight": [16],
    "mlp.gate_proj.weight": [32, 16],
    "mlp.up_proj.weight": [32, 16],
    "mlp.down_proj.weight": [16, 32],
}
SHAPES = {
    "model.embed_tokens.weight": [64, 16],
    **{f"model.layers.{i}.{name}": s for i in range(2) for name, s in LAYER.items()},
    "model.norm.weight": [16],
}
TOKENIZER = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": None,
    "post_processor": None,
    "decoder": None,
    "model": {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {"a": 0, "b": 1, "ab": 2},
        "merges": [["a", "b"]],
    },
}
# What doel-export writes for such a model (the fields read_bundle reads).
MANIFEST = {
    "format": "doel-export",
    "format_version": 2,
    "kind": "onnx",
    "model": "model.onnx",
    "vocab_size": 64,
    "context_length": 32,
    "kv_cache": {"layers": 2, "kv_heads": 2, "head_dim": 4, "past_present_share_buffer": True},
    "special_tokens": {},
}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj), encoding="utf-8")


def safetensors(path: Path, shapes: dict, header: dict | None = None) -> None:
    """F32 zeros of `shapes`, laid out as safetensors does; `header` replaces the header."""
    entries, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * math.prod(shape)
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header if header is not None else entries).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no room on disk (a hole)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# --- Hugging Face folders, for doel-export -------------------------------------------------


def checkpoint(folder: Path, config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A folder doel-export's checks take: CONFIG (updated with `config`), zero weights of
    SHAPES, TOKENIZER (or `tokenizer`)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", {**CONFIG, **(config or {})})
    safetensors(folder / "model.safetensors", SHAPES)
    write_json(folder / "tokenizer.json", tokenizer or TOKENIZER)
    return folder


def config_claims(folder: Path, **claims) -> Path:
    """config.json claiming `claims` (a shape its tensors disagree with, an absurd size)."""
    return checkpoint(folder, claims)


def replaced(folder: Path, name: str, text: str | None = None, size: int = 0) -> Path:
    """The checkpoint with its file `name` replaced by `text`, or by `size` bytes (a hole)."""
    checkpoint(folder)
    if text is None:
        sparse(folder / name, size)
    else:
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def header_beyond_the_file(folder: Path) -> Path:
    """model.safetensors whose first 8 bytes claim a header of 2^62 bytes."""
    checkpoint(folder)
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])
    return folder


def offsets_beyond_the_file(folder: Path) -> Path:
    """A tensor whose data_offsets end a terabyte past the file's end (its shape agreeing)."""
    checkpoint(folder)
    entries = {"model.embed_tokens.weight": {
        "dtype": "F32", "shape": [2**38, 1], "data_offsets": [0, 2**40]}}  # fmt: skip
    safetensors(folder / "model.safetensors", {}, header=entries)
    return folder


def huge_header(folder: Path) -> Path:
    """A header length of 17 MiB in a file that has them (a hole), over the header bound."""
    checkpoint(folder)
    path = sparse(folder / "model.safetensors", 17 * 2**20 + 8)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", 17 * 2**20))
    return folder


def index_out_of_the_folder(folder: Path, name: str = "../secret.safetensors") -> Path:
    """A shard index whose weight_map names a file outside the folder."""
    checkpoint(folder)
    write_json(folder / "model.safetensors.index.json", {"weight_map": {"lm_head.weight": name}})
    return folder


def merges(n: int) -> str:
    """tokenizer.json's text with `n` merges (the same one: a small file for a million)."""
    return json.dumps(TOKENIZER).replace('[["a", "b"]]', "[" + ",".join(['"a b"'] * n) + "]")


def tokenizer_merges(folder: Path, n: int) -> Path:
    """tokenizer.json with `n` merges."""
    checkpoint(folder)
    (folder / "tokenizer.json").write_text(merges(n), encoding="utf-8")
    return folder


def tokenizer_normalizer(folder: Path, normalizer: dict) -> Path:
    """tokenizer.json with `normalizer`."""
    return checkpoint(folder, tokenizer={**TOKENIZER, "normalizer": normalizer})


def nested_sequence(depth: int) -> dict:
    """A normalizer Sequence inside a Sequence ... `depth` deep."""
    step: dict = {"type": "Lowercase"}
    for _ in range(depth):
        step = {"type": "Sequence", "normalizers": [step]}
    return step


def replace(pattern: str, content: str, regex: bool = False) -> dict:
    return {
        "type": "Replace",
        "pattern": {"Regex" if regex else "String": pattern},
        "content": content,
    }


def huge_tokenizer(folder: Path, size: int) -> Path:
    """tokenizer.json of `size` bytes (a hole)."""
    checkpoint(folder)
    sparse(folder / "tokenizer.json", size)
    return folder


def gguf(folder: Path) -> Path:
    """A folder holding only a GGUF whose header claims 2^63 tensors and a 2^60-byte key."""
    folder.mkdir(parents=True, exist_ok=True)
    header = b"GGUF" + struct.pack("<IQQ", 3, 2**63, 1) + struct.pack("<Q", 2**60) + b"k"
    (folder / "model-q8_0.gguf").write_bytes(header)
    return folder


# --- bundles, for doel-serve -------------------------------------------------------------


def bundle(
    folder: Path, manifest: dict | str | None = None, tokenizer: str | None = None, **fields
) -> Path:
    """A bundle read_bundle takes: MANIFEST (or `manifest`, a dict or the file's text) with
    `fields` over it, an empty graph, TOKENIZER (or the text `tokenizer`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(b"")
    (folder / "tokenizer.json").write_text(tokenizer or json.dumps(TOKENIZER), encoding="utf-8")
    data = manifest if manifest is not None else {**MANIFEST, **fields}
    text = data if isinstance(data, str) else json.dumps(data)
    (folder / "manifest.json").write_text(text, encoding="utf-8")
    return folder


def kv_cache(**sizes) -> dict:
    return {"kv_cache": {**MANIFEST["kv_cache"], **sizes}}


def link_out(folder: Path, name: str) -> Path:
    """A bundle whose `name` is a symlink to a file outside it."""
    bundle(folder)
    outside = folder.parent / f"outside-{name}"
    outside.write_bytes((folder / name).read_bytes())
    (folder / name).unlink()
    os.symlink(outside, folder / name)
    return folder


def hugging_face_cache(root: Path) -> Path:
    """A bundle laid out as the Hugging Face cache keeps a download: snapshots/REV/NAME links
    to ../../blobs/HASH. Links out of the folder, but the cache's own: taken."""
    snapshot = root / "snapshots" / "0123abc"
    bundle(snapshot)
    (root / "blobs").mkdir()
    for i, path in enumerate(sorted(snapshot.iterdir())):
        blob = root / "blobs" / f"blob{i}"
        blob.write_bytes(path.read_bytes())
        path.unlink()
        os.symlink(Path("..") / ".." / "blobs" / blob.name, path)
    return snapshot
