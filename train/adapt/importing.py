"""`doel-train import`: an existing Llama, a Hugging Face folder or a llama.cpp GGUF, written as a
doel model folder that every later stage takes as it takes a training run's RUN/final.

    OUT/config.json              LlamaConfig (train/settings.py ModelConfig: doel's model loads it)
    OUT/model.safetensors        the weights under Hugging Face's names (a tied head stored once)
    OUT/tokenizer.json           the model's own tokenizer (a GGUF's rebuilt: gguf_vocab.py)
    OUT/tokenizer_config.json    its special tokens and its chat template (`chat_template`)
    OUT/special_tokens_map.json
    OUT/chat_template.jinja      the same template, as transformers 4.43+ saves it
    OUT/generation_config.json   bos, pad and every stop token (eos_token_id: EOS, end of turn)
    OUT/import.json              where it came from (the GGUF's sha256, its tokenizer's names)
    OUT/checksums.json           each file's sha256, as RUN/final records them

The rule is that nothing of the model's own is replaced by doel's: its vocabulary, split, special
tokens, chat format and context length stay its own, so an exported bundle, doel-serve's chat and
a GGUF made again render the model's prompt, not doel's. The stop tokens are EOS and the token
the chat template ends a turn with (ChatML's <|im_end|>) where that is another token. The folder
appears whole (written beside OUT, then renamed into place) or not at all.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from doel.contracts import checksums, untrusted
from doel.contracts.lock import FolderLock
from doel.train.adapt.gguf_read import read_gguf
from doel.train.adapt.hf_read import read_folder
from doel.train.adapt.shape import Refused, Source
from doel.train.common import DoelError, atomic_write_bytes, atomic_write_json

RECORD = "import.json"
# Special tokens that end a chat turn in the common templates (ChatML, Llama 3, Phi 3, Gemma):
# one the template writes becomes a stop token beside EOS.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def read_source(path: Path) -> Source:
    """The model at `path`: a .gguf file, a folder holding one GGUF, or a Hugging Face folder."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise Refused(f"{path}: not a .gguf file; pass a GGUF or a Hugging Face model folder")
        return read_gguf(path)
    if not path.is_dir():
        raise Refused(f"{path}: no such file or folder; pass a GGUF or a Hugging Face folder")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return read_gguf(ggufs[0])
        if ggufs:
            raise Refused(f"{path} holds {len(ggufs)} GGUF files; pass the one to import")
    return read_folder(path)


def stop_ids(src: Source, ids: dict[str, int]) -> list[int]:
    """EOS, the source's other stop tokens, and its chat template's end-of-turn token."""
    found = [src.config.eos_token_id]
    for value in (src.source.get("eos_token_id"), src.generation.get("eos_token_id")):
        found += value if isinstance(value, list) else [value]
    turn = [src.end_of_turn] if src.end_of_turn else []
    turn += [t for t in END_OF_TURN if src.chat_template and t in src.chat_template]
    found += [ids.get(t) for t in turn]
    return list(dict.fromkeys(i for i in found if isinstance(i, int)))


def tokenizer_config(src: Source) -> dict:
    """The model's own tokenizer_config.json fields, its special tokens and its template."""
    base = {
        # The plain fast class runs tokenizer.json as it is (no BOS handling of its own).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": src.config.max_position_embeddings,
    }
    special = {k: v for k, v in src.special.items() if v is not None}
    template = {"chat_template": src.chat_template} if src.chat_template else {}
    return base | src.tokenizer_config | special | template


def generation_config(src: Source, stops: list[int]) -> dict:
    cfg = src.config
    return src.generation | {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": stops if len(stops) > 1 else stops[0],
        "pad_token_id": cfg.pad_token_id,
    }


def _token_ids(tok: dict) -> dict[str, int]:
    ids = dict(tok["model"].get("vocab") or {}) if isinstance(tok.get("model"), dict) else {}
    return ids | {a["content"]: a["id"] for a in tok.get("added_tokens") or []}


def _check_vocabulary(src: Source) -> None:
    try:
        size = Tokenizer.from_str(json.dumps(src.tokenizer)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the tokenizers library raises bare Exceptions on bad input
        raise Refused(f"its tokenizer cannot be built ({e})"[:300]) from None
    if size > src.config.vocab_size:
        raise Refused(
            f"its tokenizer has {size} tokens but the embedding {src.config.vocab_size} rows; "
            f"{untrusted.AGAIN}"
        )


def write_folder(src: Source, stage: Path, record: dict) -> None:
    """Every file of the imported model into `stage` (a new folder)."""
    stage.mkdir(parents=True)
    save_file(src.tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
    dtypes = {DTYPES.get(t.dtype, "float32") for t in src.tensors.values()}
    config = src.config.to_hf() | {"torch_dtype": dtypes.pop() if len(dtypes) == 1 else "float32"}
    atomic_write_json(stage / "config.json", config)
    atomic_write_json(stage / "tokenizer.json", src.tokenizer)
    tok_config = tokenizer_config(src)
    atomic_write_json(stage / "tokenizer_config.json", tok_config)
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    atomic_write_json(
        stage / "special_tokens_map.json", {k: tok_config[k] for k in names if k in tok_config}
    )
    if src.chat_template:
        atomic_write_bytes(stage / "chat_template.jinja", src.chat_template.encode("utf-8"))
    stops = stop_ids(src, _token_ids(src.tokenizer))
    atomic_write_json(stage / "generation_config.json", generation_config(src, stops))
    atomic_write_json(stage / RECORD, record)
    # safetensors writes its file 0600; it gets the mode the umask gives (config.json's).
    (stage / "model.safetensors").chmod(stat.S_IMODE((stage / "config.json").stat().st_mode))
    atomic_write_json(stage / checksums.NAME, checksums.record(stage))


def import_model(source: str | Path, out: str | Path, force: bool = False, log=print) -> Path:
    """Read `source`, check it, write OUT whole (replacing it only with `force`); returns OUT."""
    source, out = Path(source), Path(out)
    if out.exists() and not force and any(out.iterdir() if out.is_dir() else [out]):
        raise DoelError(f"{out} exists; pass --force to replace it, or choose another --out")
    try:
        src = read_source(source)
        _check_vocabulary(src)
    except untrusted.UntrustedError as e:
        raise Refused(str(e)) from None
    record = {"format": "doel-import", "version": 1, "source": src.source}
    if source.is_file():
        record["source"] = src.source | {"sha256": checksums.sha256_file(source)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with FolderLock(out, "doel-train import", DoelError):
        stage = out.parent / f".{out.name}.importing"
        shutil.rmtree(stage, ignore_errors=True)
        try:
            write_folder(src, stage, record)
            if out.exists():
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            stage.rename(out)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    cfg = src.config
    log(
        f"imported {source.name} into {out}: {cfg.num_hidden_layers} layers of width "
        f"{cfg.hidden_size}, {cfg.vocab_size:,} tokens, context {cfg.max_position_embeddings:,}, "
        f"chat template {'kept' if src.chat_template else 'none'}"
    )
    return out
