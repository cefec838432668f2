"""A llama.cpp GGUF read back as a Hugging Face Llama: its metadata as config.json's fields, its
tensors dequantized to float32 under Hugging Face's names, its vocabulary as a tokenizer.json
(gguf_vocab.py), its chat template and special tokens.

Weights: llama.cpp's converter reorders each query and key head's rows from Hugging Face's
rotary layout (the first halves, then the second halves) to adjacent pairs, the layout its rope
kernel rotates (doel-export's GGUF writer does the same, export/gguf.py `_interleave`); reading
puts them back, so the model's logits are those llama.cpp computes from the same numbers.
Quantized tensors are dequantized with the `gguf` package's reference decoders: the weights are
then the quantized model exactly, its quantization noise included (a Q4_1 file gives back Q4_1's
numbers, not the float model it was made from). A tensor llama.cpp's Llama would not have (a
bias, rope frequency factors) or a type gguf cannot decode is refused, naming it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from doel.contracts import untrusted
from doel.train.adapt.gguf_vocab import tokenizer_json
from doel.train.adapt.shape import Refused, Source, check_shapes, model_config
from doel.train.settings import ModelConfig

TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
PER_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
# The metadata an array may be long in (the vocabulary); any other array is refused unread.
ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise Refused(f"{path}: not a GGUF file gguf can read ({e})"[:300]) from None


def metadata(reader: gguf.GGUFReader, path: Path) -> dict:
    """Every key's value; an array other than the vocabulary's is kept only when short."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and key not in ARRAYS:
            if len(field.data) > 64:  # languages, tags: a few entries
                continue
        try:
            meta[key] = field.contents()
        except UnicodeDecodeError:
            raise Refused(f"{path}: {key} is not UTF-8 text; {untrusted.AGAIN}") from None
    return meta


def hf_config(meta: dict, path: Path, tied: bool) -> ModelConfig:
    """config.json's Llama fields from `llama.*` metadata, checked as a folder's config is;
    `tied`: the file has no output.weight (llama.cpp then reads the embedding as the head)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise Refused(
            f"{path.name}: general.architecture is {arch!r}, not 'llama'; doel imports Llama "
            "models only (train/model.py)"
        )
    a = "llama."
    if meta.get(a + "expert_count"):
        raise Refused(f"{path.name}: {a}expert_count is set (a mixture of experts, not a Llama)")
    scaling = meta.get(a + "rope.scaling.type")
    heads = meta.get(a + "attention.head_count")
    width = meta.get(a + "embedding_length")
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        value = meta.get(a + key)
        if value is not None and isinstance(heads, int) and heads and value * heads != width:
            raise Refused(
                f"{path.name}: {a}{key} is {value}, not embedding_length {width} / {heads} "
                "heads; doel imports Llama models only (train/model.py)"
            )
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": width,
        "intermediate_size": meta.get(a + "feed_forward_length"),
        "num_hidden_layers": meta.get(a + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(a + "attention.head_count_kv", heads),
        "max_position_embeddings": meta.get(a + "context_length"),
        "rms_norm_eps": float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(a + "rope.freq_base", 10000.0)),
        "rope_scaling": None if scaling in (None, "none") else {"rope_type": scaling},
        "vocab_size": meta.get(a + "vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []),
        "tie_word_embeddings": tied,
    }
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("pad", "padding_token_id")):  # fmt: skip
        cfg[f"{role}_token_id"] = meta.get(f"tokenizer.ggml.{key}")
    return model_config(cfg, path.name)


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp Llama tensor, or None for one a Llama lacks."""
    if name in TOP:
        return TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if parts[2] in PER_LAYER:
            return f"model.layers.{parts[1]}.{PER_LAYER[parts[2]]}.weight"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's adjacent rotary pairs back to Hugging Face's halves:
    the inverse of export/gguf.py's `_interleave`."""
    pairs = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def tensors(reader: gguf.GGUFReader, cfg: ModelConfig, path: Path) -> dict[str, torch.Tensor]:
    """Every weight, float32, under its Hugging Face name; shapes checked before any is read."""
    named, shapes = {}, {}
    for t in reader.tensors:
        hf = hf_name(t.name)
        if hf is None:
            what = "rope frequency factors (a rope scaling)" if "rope_freqs" in t.name else None
            raise Refused(
                f"{path.name}: tensor {t.name} is {what or 'not one of a Llama'}; doel imports "
                "Llama models only (train/model.py)"
            )
        named[hf] = t
        shapes[hf] = tuple(int(n) for n in reversed(t.shape))  # ggml lists the fastest dim first
    check_shapes(shapes, cfg, path.name)
    out = {}
    for hf, t in named.items():
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise Refused(
                f"{path.name}: {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                "dequantize; convert the GGUF to q8_0 or f16 with llama-quantize first"
            ) from None
        w = np.array(w, dtype=np.float32).reshape(shapes[hf])  # a copy: the file is read-only
        if hf.endswith("q_proj.weight"):
            w = unpermute(w, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute(w, cfg.num_key_value_heads)
        out[hf] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def read_gguf(path: Path) -> Source:
    """What an import writes from a GGUF: config, tensors, tokenizer.json, template, tokens."""
    reader = open_gguf(path)
    meta = metadata(reader, path)
    cfg = hf_config(meta, path, tied=all(t.name != "output.weight" for t in reader.tensors))
    try:
        tok = tokenizer_json(meta, cfg.vocab_size)
    except (Refused, untrusted.UntrustedError) as e:
        raise Refused(f"{path.name}: {e}") from None
    weights = tensors(reader, cfg, path)
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise Refused(f"{path.name}: tokenizer.chat_template is not text; {untrusted.AGAIN}")
    return Source(
        config=cfg,
        tensors=weights,
        tokenizer=tok,
        tokenizer_config={},  # BOS, where the GGUF adds it, is tokenizer.json's to add
        chat_template=template,
        generation={},
        source={
            "kind": "gguf",
            "name": path.name,
            "model_name": meta.get("general.name"),
            "organization": meta.get("general.organization"),
            "license": meta.get("general.license"),
            "file_type": meta.get("general.file_type"),
            "tokenizer": {
                "model": meta.get("tokenizer.ggml.model"),
                "pre": meta.get("tokenizer.ggml.pre"),
            },
        },
        end_of_turn=token("eot_token_id"),
        special={
            "bos_token": token("bos_token_id"),
            "eos_token": token("eos_token_id"),
            "pad_token": token("padding_token_id"),
            "unk_token": token("unknown_token_id"),
        },
    )
