"""The adapted model before any training: the base's weights with an embedding row (and, untied,
a head row) for every token of the new vocabulary, each new row made from what the base knows.

A new token's row is the mean of the base's rows of the token's text as the base tokenizes it
(for an extended vocabulary the token's base pieces, which is exact: extend builds every new
token from base tokens). This is the simple initialisation of new vocabulary that
"Fast Vocabulary Transfer" (Gee et al., 2022) and Hewitt's note on initialising new word
embeddings (2021) study; FOCUS (Dobler and de Melo, 2023) and WECHSEL (Minixhofer et al., 2022)
weight the base's tokens by a similarity learned elsewhere (fastText vectors), which this project
does not ship. The same mean transplants a replaced vocabulary (tokenizer=spm): each doel token's
text under the base tokenizer, its byte tokens from the base's byte-level letter, its special
tokens from the base's special tokens of the same role. A row the base cannot spell (none in
practice) gets the mean of all rows.

`write_adapted` writes OUT as `doel-train import` does (train/adapt/importing.py): the base's
chat template, special tokens and stop tokens are kept, so that export and serve render the
base's prompt. The folder appears whole, or not at all.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from doel.contracts import checksums
from doel.train.common import DoelError, atomic_write_bytes, atomic_write_json
from doel.train.data.tokenizer import write_hf_side_files
from doel.train.hf import WEIGHTS, generation_config, read_config, read_safetensors

RECORD = "adapt.json"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
# doel's special tokens (replaced vocabulary) and the base's tokens of the same role
ROLES = {
    "<|bos|>": ("<|endoftext|>", "<s>", "<|begin_of_text|>"),
    "<|eos|>": ("<|endoftext|>", "</s>", "<|end_of_text|>"),
    "<|pad|>": ("<|endoftext|>", "<pad>"),
    "<|end|>": ("<|im_end|>", "<|eot_id|>", "<|end|>"),
    "<|system|>": ("<|im_start|>", "system"),
    "<|user|>": ("<|im_start|>", "user"),
    "<|assistant|>": ("<|im_start|>", "assistant"),
}


def _byte_char(b: int) -> str:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return chr(b) if b in keep else chr(256 + sum(1 for c in range(b) if c not in keep))


def base_pieces(base: Tokenizer, adapted: dict, ids: list[int], extended: bool) -> list[list[int]]:
    """For each id of the adapted vocabulary, the base ids its row is the mean of."""
    inv = {v: k for k, v in adapted["model"]["vocab"].items()}
    inv |= {a["id"]: a["content"] for a in adapted.get("added_tokens") or []}
    out = []
    for i in ids:
        token = inv.get(i, "")
        if extended:
            found = [base.token_to_id(t.value) for t in base.model.tokenize(token)]
        elif token in ROLES:
            found = [base.token_to_id(r) for r in ROLES[token]]
            found = [j for j in found if j is not None] or base.encode(ROLES[token][-1]).ids
        elif token.startswith("<0x") and len(token) == 6:
            found = [base.token_to_id(_byte_char(int(token[3:5], 16)))]
        else:
            found = base.encode(token.replace("\u2581", " "), add_special_tokens=False).ids
        out.append([j for j in found if j is not None])
    return out


def mean_rows(weight: torch.Tensor, pieces: list[list[int]]) -> torch.Tensor:
    """One row a token: the mean of `weight`'s rows of its pieces (all rows when it has none)."""
    fallback = weight.float().mean(0)
    rows = [weight[p].float().mean(0) if p else fallback for p in pieces]
    return torch.stack(rows).to(weight.dtype) if rows else weight[:0]


def adapted_tensors(
    tensors: dict, base: Tokenizer, adapted: dict, size: int, extended: bool
) -> dict[str, torch.Tensor]:
    """The base's tensors with the embedding (and an untied head) of `size` rows: an extended
    vocabulary keeps the base's rows and appends new ones; a replaced one is all new rows."""
    out = dict(tensors)
    old = tensors[EMBED].shape[0]
    ids = list(range(old, size)) if extended else list(range(size))
    pieces = base_pieces(base, adapted, ids, extended)
    for name in (EMBED, HEAD):
        if name in tensors:
            w = tensors[name]
            new = mean_rows(w, pieces)
            out[name] = torch.cat([w, new]) if extended else new
    return out


def write_adapted(
    base_dir: Path, adapted: dict, out: Path, extended: bool, record: dict
) -> dict[str, int]:
    """OUT: the base folder with the `adapted` tokenizer.json and its rows (see above).
    Returns {"base_vocab", "vocab", "new"}."""
    base_json = json.loads((base_dir / "tokenizer.json").read_text(encoding="utf-8"))
    base = Tokenizer.from_str(json.dumps(base_json))
    tok = Tokenizer.from_str(json.dumps(adapted))
    size = tok.get_vocab_size(with_added_tokens=True)
    cfg = read_config(base_dir)
    if cfg.vocab_size != base.get_vocab_size(with_added_tokens=True):
        raise DoelError(
            f"{base_dir}: its embedding has {cfg.vocab_size} rows, its tokenizer "
            f"{base.get_vocab_size(with_added_tokens=True)} tokens; import it again"
        )
    tensors = read_safetensors(base_dir / WEIGHTS)
    tensors = adapted_tensors(tensors, base, adapted, size, extended)
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    config["vocab_size"] = size
    if not extended:  # doel's vocabulary: its own document and pad ids
        config |= {k: tok.token_to_id(t) for k, t in _DOEL_IDS.items()}
    stage = out.parent / f".{out.name}.adapting"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        save_file(tensors, str(stage / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(stage / "config.json", config)
        text = json.dumps(adapted, ensure_ascii=False, indent=1)
        atomic_write_bytes(stage / "tokenizer.json", text.encode("utf-8"))
        if extended:
            copy_side_files(base_dir, stage)
        else:  # doel's vocabulary: doel's template and special tokens
            write_hf_side_files(stage)
            atomic_write_json(
                stage / "generation_config.json", generation_config(read_config(stage))
            )
        counts = {"base_vocab": cfg.vocab_size, "vocab": size, "new": max(0, size - cfg.vocab_size)}
        atomic_write_json(stage / RECORD, record | counts)
        (stage / WEIGHTS).chmod(stat.S_IMODE((stage / "config.json").stat().st_mode))
        atomic_write_json(stage / checksums.NAME, checksums.record(stage))
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return counts


_DOEL_IDS = {"bos_token_id": "<|bos|>", "eos_token_id": "<|eos|>", "pad_token_id": "<|pad|>"}


def copy_side_files(base_dir: Path, out: Path) -> None:
    """The base's tokenizer side files (its chat template, special and stop tokens) into out."""
    for name in SIDE_FILES:
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, out / name)


def keep_tokenizer_files(folder: Path, source: Path) -> Path:
    """`folder` (a run's final model, written with doel's tokenizer side files) given the
    adapted model's tokenizer files instead: its tokenizer.json, the base's chat template,
    special and stop tokens; its checksums written again. Returns folder."""
    for name in ("tokenizer.json", RECORD, *SIDE_FILES):
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    atomic_write_json(folder / checksums.NAME, checksums.record(folder))
    return folder
