"""Checkpoint -> GGUF for llama.cpp, Ollama and LM Studio: DIR/model-<quant>.gguf (weights,
tokenizer, chat template when tokenizer_config.json has one, metadata) and an Ollama Modelfile.

The tokenizer is the hard part. llama.cpp does not run tokenizer.json: it runs its own
tokenizers, picked by `tokenizer.ggml.model` and a pre-tokenizer name. Only a tokenizer that one
of them reproduces id for id is written, in one of two forms:
- SentencePiece (llama.cpp's "llama" model, as for Llama 2): BPE over characters with byte
  fallback, no pre-tokenizer, a normalizer that only puts "▁" in front and turns spaces into "▁",
  merges ranked as the pieces' scores. That is what `doel-train tokenizer --style spm` trains;
  the GGUF gets each piece's score (minus its rank), byte tokens and the "▁" prefix flag.
- byte-level BPE (llama.cpp's "gpt2" model) whose splits are verbatim those of one of
  llama.cpp's pre-types (PRE_TYPES), no normalizer, no extra word marks: doel's `--style gguf`
  (a Split with the qwen35 regex), and a stranger's as tokenizers writes GPT-2's (the ByteLevel
  step's own split) or SmolLM's (single digits first). The GGUF gets the tokens, their types and
  the merges, and names the pre-type.
Any other tokenizer (the doel style included: characters with byte fallback, doel's own split
and NFC) is refused with a line saying so, never written as a GGUF that silently tokenizes
differently. This module reads tokenizer.json only (export imports nothing from train/).

Weights: Hugging Face's Llama stores each q/k head's rotary pairs as two halves; llama.cpp's llama
architecture rotates adjacent pairs, so q_proj and k_proj rows are interleaved on the way (the
same reordering llama.cpp's own converter applies). Each format is a row of doel.contracts.quant:
its llama.cpp type, its file type, its block (a row it does not fill stays f32) and its head's
bits (q4_0 keeps the embedding and head at q8_0, as doel's int4 keeps its head at 8 bits); q8_0
and q4_0 are gguf-py's reference quantizers.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from doel.contracts.manifest import Manifest
from doel.contracts.quant import DEFAULT_GGUF, Quant, at_bits
from doel.contracts.quant import quant as quant_row
from doel.export import card
from doel.export.checkpoint import Checkpoint, inspect_checkpoint, source_record
from doel.export.common import ExportError, file_table, staging, write_json
from doel.export.modelfile import (
    RAW_TEMPLATE,
    chat_template,
    modelfile,
    ollama_template,
)
from doel.export.tokenform import (
    DIGIT,
    GPT2_SPLIT,
    is_sentencepiece,
    splits,
    why_not_byte_level,
)

EMBEDDING_AND_HEAD = ("token_embd.weight", "output.weight")  # at the row's head_bits
STYLE_HINT = (
    "train one it can with `doel-train tokenizer --style spm` or `--style gguf` (and a model on "
    "it), or export this one to ONNX (doel-export without --format gguf)"
)
# A byte-level BPE's split regexes (tokenform.splits, tokenizers' form) -> the llama.cpp pre-type
# that runs them (src/llama-vocab.cpp, `llm_tokenizer_bpe`; the pre-type also implies its flags:
# qwen35 keeps spaces and applies every merge by rank). llama.cpp writes GPT-2's split without
# tokenizers' last "|\s+" and runs it by hand (unicode.cpp), whitespace at the end included.
PRE_TYPES = {
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ): "qwen35",
    (GPT2_SPLIT,): "gpt2",
    # Digits(individual_digits) then ByteLevel: StarCoder's and SmolLM's (the same regexes)
    (DIGIT, GPT2_SPLIT): "smollm",
}
# gguf TokenType values
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6


def _refuse(path: Path, why: str) -> ExportError:
    return ExportError(
        f"{path}: llama.cpp cannot tokenize as this tokenizer does ({why}); {STYLE_HINT}"
    )


def llama_cpp_pre_type(tok: dict, path: Path) -> str:
    """The llama.cpp pre-type that tokenizes like this tokenizer.json id for id ("llama": the
    SentencePiece form, which has none); ExportError naming the first difference otherwise."""
    if is_sentencepiece(tok):
        return "llama"
    why = why_not_byte_level(tok)
    if why is not None:
        raise _refuse(path, why)
    pre = PRE_TYPES.get(splits(tok))
    if pre is None:
        raise _refuse(path, "its split regexes are none of llama.cpp's pre-tokenizers")
    return pre


def _specials(tok: dict, path: Path) -> tuple[bool, bool]:
    """(add BOS, add EOS) from the post-processor: only a special token before and/or after the
    text is something llama.cpp can add. A ByteLevel step there only moves offsets."""
    post = tok.get("post_processor")
    steps = post.get("processors", []) if post and post.get("type") == "Sequence" else [post]
    templates = [s for s in steps if s and s.get("type") != "ByteLevel"]
    if not templates:
        return False, False
    post = templates[0]
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    kinds = [next(iter(p)) for p in single or []]
    if len(templates) > 1 or single is None or kinds.count("Sequence") != 1 or len(kinds) > 3:
        raise _refuse(path, "its post-processor is not a template around the text")
    at = kinds.index("Sequence")
    return at == 1, len(kinds) - at == 2


def vocabulary(tok: dict, size: int) -> tuple[list[str], list[int]]:
    """Token strings and gguf token types by id, `size` of them (the embedding's rows)."""
    tokens: list[str | None] = [None] * size
    types = [UNUSED] * size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, NORMAL
    for a in tok.get("added_tokens", []):
        tokens[a["id"]], types[a["id"]] = a["content"], CONTROL if a["special"] else USER_DEFINED
    return [t if t is not None else f"<|unused_{i}|>" for i, t in enumerate(tokens)], types


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from [first halves | second halves] to alternating pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _tensors(ckpt: Checkpoint):
    """(gguf name, float32 array) for every weight, in llama.cpp's names and layout."""
    cfg = ckpt.config
    heads, kv = cfg["num_attention_heads"], ckpt.kv_heads
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for path in ckpt.weights:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key not in names:
                    raise ExportError(f"{path}: weight {key} has no place in a llama GGUF")
                w = f.get_tensor(key).float().numpy()
                if key.endswith("q_proj.weight"):
                    w = _interleave(w, heads)
                elif key.endswith("k_proj.weight"):
                    w = _interleave(w, kv)
                yield names[key], w


def _check_arch(ckpt: Checkpoint) -> None:
    cfg = ckpt.config
    if ckpt.model_type != "llama":
        raise ExportError(f"--format gguf writes Llama models; this one is {ckpt.model_type!r}")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ExportError(f"config.json sets {key}, which the GGUF writer does not carry")
    if cfg.get("rope_scaling"):
        raise ExportError("config.json sets rope_scaling, which the GGUF writer does not carry")


def _ggml(row: Quant) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[row.gguf_type.upper()]


def tensor_type(row: Quant, name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
    """The llama.cpp type a tensor of format `row` is written in: f32 for the norms (and a row
    its block does not fill), the head's type for the embedding and the head, the body's else."""
    if len(shape) == 1 or (row.block_size and shape[-1] % row.block_size):
        return gguf.GGMLQuantizationType.F32
    if name in EMBEDDING_AND_HEAD and row.head_bits != row.bits:
        return _ggml(at_bits(row.head_bits, "gguf"))
    return _ggml(row)


def _add_vocabulary(w: gguf.GGUFWriter, tok: dict, size: int, pre: str) -> None:
    tokens, types = vocabulary(tok, size)
    if pre == "llama":
        # llama.cpp merges the pair whose piece scores highest; the merges' ranks are the pieces'
        # order, so a piece's score is minus its id. Byte tokens are typed so that llama.cpp
        # spells an unknown character with them and decodes them as bytes.
        scores = [0.0] * size
        for text, i in tok["model"]["vocab"].items():
            if types[i] == NORMAL:
                scores[i] = -float(i)
                if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    types[i], scores[i] = BYTE, 0.0
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(True)  # the normalizer's "▁" in front
        return
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])


def write_gguf(ckpt: Checkpoint, path: Path, row: Quant, name: str) -> dict:
    """Write the GGUF file in the format `row`; returns what the manifest records."""
    tok = json.loads(ckpt.tokenizer.read_text(encoding="utf-8"))
    pre = llama_cpp_pre_type(tok, ckpt.tokenizer)
    add_bos, add_eos = _specials(tok, ckpt.tokenizer)
    _check_arch(ckpt)
    cfg = ckpt.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(ckpt.context_length)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(ckpt.kv_heads)
    w.add_key_length(ckpt.head_dim)
    w.add_value_length(ckpt.head_dim)
    w.add_rope_dimension_count(ckpt.head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(ckpt.vocab_size)
    w.add_file_type(row.gguf_ftype)
    if row.quantized:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(w, tok, ckpt.vocab_size, pre)
    for role, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                      ("pad", w.add_pad_token_id)):  # fmt: skip
        if role in ckpt.special_tokens:
            add(ckpt.special_tokens[role]["id"])
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    template = chat_template(ckpt)
    if template is not None:
        w.add_chat_template(template)
    end = ckpt.special_tokens.get("end_of_turn")
    if end is not None:  # llama.cpp ends a reply there (its end-of-generation set)
        w.add_eot_token_id(end["id"])
    types_written = {}
    for gname, arr in _tensors(ckpt):
        t = tensor_type(row, gname, arr.shape)
        if t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(gname, arr.astype(np.float32 if t.name == "F32" else np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, t), raw_dtype=t)
        types_written[gname] = t.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"pre_tokenizer": pre, "chat_template": template is not None, "tensors": types_written}


def export_gguf(
    checkpoint: str | Path,
    out: str | Path,
    quant: str = DEFAULT_GGUF,
    force: bool = False,
    tokenizer: str | Path | None = None,
    log=print,
    repo_id: str | None = None,
    verify: bool = True,
) -> dict:
    """Write OUT/model-<quant>.gguf, OUT/Modelfile, OUT/README.md (the model card, naming the
    Hub repository `repo_id`: export/card.py) and OUT/manifest.json, all or nothing. `verify`:
    the checkpoint's files checked against its recorded hashes first, where it records them."""
    try:
        row = quant_row(quant, "gguf")
    except ValueError as e:
        raise ExportError(f"--quant: {e}") from None
    if repo_id is not None:
        card.check_repo_id(repo_id)
    ckpt = inspect_checkpoint(checkpoint, tokenizer, verify=verify)
    tok = json.loads(ckpt.tokenizer.read_text(encoding="utf-8"))
    llama_cpp_pre_type(tok, ckpt.tokenizer)  # refuse before any work
    out = Path(out)
    name = f"model-{row.name}.gguf"
    with staging(out, force) as stage:
        info = write_gguf(ckpt, stage / name, row, ckpt.folder.resolve().name)
        (stage / "Modelfile").write_text(modelfile(name, ckpt), encoding="utf-8")
        source = source_record(ckpt)
        record = Manifest(
            kind="gguf",
            gguf=name,
            quant=row.name,
            vocab_size=ckpt.vocab_size,
            context_length=ckpt.context_length,
            special_tokens=ckpt.special_tokens,
            # Which checkpoint by name and hashes, as the ONNX bundle says it: no absolute path.
            extra={"checkpoint": source["folder"], "config_sha256": ckpt.config_sha256}
            | {"source": source, **info},
        )
        result = record.to_dict()
        card.write_card(stage, result, out.resolve().name, ckpt.folder, repo_id)
        result["files"] = file_table(stage)
        write_json(stage / "manifest.json", Manifest.from_dict(result).to_dict())
    log(f"wrote {out / name} ({info['pre_tokenizer']} pre-tokenizer) and {out / 'Modelfile'}")
    if ollama_template(ckpt) == RAW_TEMPLATE:
        log("    its TEMPLATE is {{ .Prompt }}: the checkpoint has no doel chat template")
    return result
