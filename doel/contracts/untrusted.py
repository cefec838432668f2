"""Bounds on what a model folder written by someone else may make doel read, hold or allocate.

doel-export reads a Hugging Face folder (config.json, safetensors headers, a shard index,
tokenizer.json) and doel-serve a bundle (manifest.json, tokenizer.json, tokenizer_config.json),
folders that users download from strangers. Every number in them is a claim: a reader that sizes
an array, a read or a loop by a claim before checking it can be made to allocate terabytes, or to
run for minutes, by a file of a few bytes. So each claim is checked here, against a bound stated
once below with why it is where it is, before anything is sized by it. A claim over its bound or
of the wrong type, or a file name that leads out of the folder, is an UntrustedError in one line
that names the file and the field.

The bounds are far above any published model's: they do not limit which models doel takes, they
check that a number is a model's at all. The one that depends on the machine, the KV cache a
bundle asks doel-serve to allocate, is checked against its memory. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# A model's sizes (config.json, manifest.json). Published decoders have at most ~130 layers,
# 128 heads, widths of ~53,000 (Llama 3 405B's feed-forward), ~262,000 tokens (Gemma 3) and
# 10 million positions (Llama 4 Scout): each bound is several times that.
MAX_LAYERS = 1024  # num_hidden_layers / n_layer, kv_cache.layers
MAX_HEADS = 1024  # num_attention_heads / n_head, num_key_value_heads, kv_cache.kv_heads
MAX_WIDTH = 2**18  # hidden_size / n_embd, intermediate_size / n_inner, head_dim
MAX_VOCAB = 2**20  # vocab_size; also a tokenizer's vocabulary, merges and added tokens
MAX_CONTEXT = 2**24  # max_position_embeddings / n_positions / n_ctx, context_length

# Files read whole into memory, bounded before they are opened. A JSON record of a folder is a
# few KB (a shard index of the largest models ~100 KB, a tokenizer_config.json with a chat
# template and every added token a few MB); the largest published tokenizer.json is ~33 MB
# (Gemma 3); a safetensors header is ~100 bytes per tensor, ~1 MB for ten thousand tensors.
MAX_RECORD_BYTES = 16 * 2**20  # config.json, manifest.json, the shard index, tokenizer_config
MAX_TOKENIZER_BYTES = 64 * 2**20  # tokenizer.json
MAX_SAFETENSORS_HEADER_BYTES = 16 * 2**20  # the header length in a safetensors file's first 8

# tokenizer.json's pipeline (normalizer, pre-tokenizer, post-processor, decoder) runs on every
# text the model reads or writes, so its cost is paid on every request. Published pipelines have
# fewer than 10 steps, nested 2 deep, with patterns of ~200 characters and replacements of one
# or two; the tokenizers library itself stops at JSON nested 128 deep, raising, not refusing.
MAX_STEPS = 256  # steps of the four parts together
MAX_DEPTH = 16  # a Sequence in a Sequence ...
MAX_PATTERN_CHARS = 4096  # a Replace or Split pattern, a Replace's content, a Prepend
# How many times longer the normalizer's Replace steps may make a text, counted the safe way (a
# regex may match the empty string between any two characters, inserting its content there):
# chained replacements otherwise multiply a request's text beyond any memory.
MAX_GROWTH = 1024

AGAIN = "the folder is damaged or not a model's; get it again from where it came from"
PIPELINE = ("normalizer", "pre_tokenizer", "post_processor", "decoder")


class UntrustedError(ValueError):
    """A claim in a folder's file that is over its bound, of the wrong type, or that leads out of
    the folder; the message (one line) names the file and the field."""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def whole(value, field: str, most: int, least: int = 1) -> int:
    """`value` if it is a whole number (a JSON integer, not true/false, not 1e9) from `least` to
    `most`; UntrustedError naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UntrustedError(f"{field} is {_shown(value)}, not a whole number; {AGAIN}")
    if not least <= value <= most:
        raise UntrustedError(
            f"{field} is {value}, outside {least}..{most:,}, the bound doel sets for any "
            f"model's; {AGAIN}"
        )
    return value


def sizes(record: dict, bounds: dict[str, int], where: str) -> None:
    """Each of `bounds`' keys that `record` has (null counts as absent) checked by `whole`."""
    for key, most in bounds.items():
        if record.get(key) is not None:
            whole(record[key], f"{where} {key}", most)


# config.json's size fields, under Llama's and GPT-2's names.
CONFIG_BOUNDS = {
    "vocab_size": MAX_VOCAB,
    "hidden_size": MAX_WIDTH,
    "n_embd": MAX_WIDTH,
    "intermediate_size": MAX_WIDTH,
    "n_inner": MAX_WIDTH,
    "head_dim": MAX_WIDTH,
    "num_hidden_layers": MAX_LAYERS,
    "n_layer": MAX_LAYERS,
    "num_attention_heads": MAX_HEADS,
    "n_head": MAX_HEADS,
    "num_key_value_heads": MAX_HEADS,
    "max_position_embeddings": MAX_CONTEXT,
    "n_positions": MAX_CONTEXT,
    "n_ctx": MAX_CONTEXT,
}


def file_bytes(path: Path, most: int) -> int:
    """The size of `path`, refused over `most` before a byte is read."""
    size = path.stat().st_size
    if size > most:
        raise UntrustedError(
            f"{path} is {size:,} bytes, more than the {most:,} doel reads for it; {AGAIN}"
        )
    return size


def read_record(path: Path, most: int = MAX_RECORD_BYTES):
    """The JSON in `path`, its size bounded first; ValueError (json's, or UntrustedError) when
    it is not JSON, or is nested past what the parser recurses into."""
    file_bytes(path, most)
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise UntrustedError(f"{path} is JSON nested too deep to read; {AGAIN}") from None


def plain_name(name, field: str) -> str:
    """`name` if it names a file in the folder itself: not a path (no "/", "\\", "..")."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or any(c in name for c in "/\\\0")
        or Path(name).is_absolute()
    ):
        raise UntrustedError(
            f"{field} is {_shown(name)}, not the name of a file in the folder; {AGAIN}"
        )
    return name


def inside(folder: Path, path: Path, field: str) -> None:
    """Refuse `path` when it resolves (through symlinks) outside `folder`. The Hugging Face
    cache's own layout, snapshots/REVISION/NAME linking to ../../blobs/HASH, is inside."""
    root = folder.resolve()
    target = path.resolve()
    if target.is_relative_to(root):
        return
    if root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs":
        return
    raise UntrustedError(
        f"{field}: {path} is a link to {target}, outside the folder {root}; copy the file into "
        "the folder (cp -L), or get the folder again"
    )


def memory_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_tokenizer(path: Path) -> dict | None:
    """tokenizer.json's counts and pipeline checked against the bounds above, before the
    tokenizers library builds it; its JSON, or None when it is not a JSON object (then the
    reader that follows names it as damaged: tokenizers, or serve's checksums)."""
    file_bytes(path, MAX_TOKENIZER_BYTES)
    try:
        tok = read_record(path, MAX_TOKENIZER_BYTES)
    except UntrustedError:
        raise
    except ValueError:
        return None
    if not isinstance(tok, dict):
        return None
    model = tok.get("model") if isinstance(tok.get("model"), dict) else {}
    for where, items in (
        ("model.vocab", model.get("vocab")),
        ("model.merges", model.get("merges")),
        ("added_tokens", tok.get("added_tokens")),
    ):
        if isinstance(items, (dict, list)) and len(items) > MAX_VOCAB:
            raise UntrustedError(
                f"{path} {where} has {len(items):,} entries, more than the {MAX_VOCAB:,} doel "
                f"reads (MAX_VOCAB); {AGAIN}"
            )
    steps, growth = 0, 1
    for part in PIPELINE:
        n, g = _pipeline(tok.get(part), f"{path} {part}")
        steps, growth = steps + n, growth * (g if part == "normalizer" else 1)
    if steps > MAX_STEPS:
        raise UntrustedError(
            f"{path} normalizer, pre_tokenizer, post_processor and decoder have {steps} steps, "
            f"more than the {MAX_STEPS} doel runs on every text (MAX_STEPS); {AGAIN}"
        )
    if growth > MAX_GROWTH:
        raise UntrustedError(
            f"{path} normalizer: its Replace steps can make a text {growth:,} times longer, more "
            f"than the {MAX_GROWTH:,} doel accepts (MAX_GROWTH); {AGAIN}"
        )
    return tok


def _pipeline(part, where: str) -> tuple[int, int]:
    """(steps, growth) of one part of the pipeline: every object with a "type" is a step."""
    steps, growth = 0, 1
    stack = [(part, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, depth) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if "type" in node:
            steps, depth = steps + 1, depth + 1
            if depth > MAX_DEPTH:
                raise UntrustedError(
                    f"{where} nests its steps {depth} deep, deeper than the {MAX_DEPTH} doel "
                    f"reads (MAX_DEPTH); {AGAIN}"
                )
            if node["type"] == "Replace":
                growth *= _growth(node, where)
        for key in ("pattern", "content", "prepend", "String", "Regex"):
            if isinstance(node.get(key), str) and len(node[key]) > MAX_PATTERN_CHARS:
                raise UntrustedError(
                    f"{where} has a {key} of {len(node[key]):,} characters, more than the "
                    f"{MAX_PATTERN_CHARS:,} doel reads (MAX_PATTERN_CHARS); {AGAIN}"
                )
        stack.extend((v, depth) for v in node.values() if isinstance(v, (dict, list)))
    return steps, growth


def _growth(step: dict, where: str) -> int:
    """How many times longer one Replace can make a text: its content per character a plain
    pattern replaces; a regex may match the empty string, adding its content at every place."""
    content = step.get("content")
    pattern = step.get("pattern") if isinstance(step.get("pattern"), dict) else {}
    if not isinstance(content, str):
        raise UntrustedError(f"{where} has a Replace whose content is not a string; {AGAIN}")
    plain = pattern.get("String")
    if isinstance(plain, str) and plain:
        return max(1, math.ceil(len(content) / len(plain)))
    return len(content) + 1
