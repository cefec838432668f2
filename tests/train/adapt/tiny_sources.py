"""Tiny models in the two forms `doel-train import` reads, made here as their own tools make them:
a Hugging Face folder saved by transformers (a random LlamaForCausalLM, a byte-level BPE trained
on the built-in sample with SmolLM's split, digits alone then GPT-2's regex, and ChatML), and a
GGUF written from that folder with gguf's GGUFWriter as llama.cpp's converter lays one out (its
names, the q/k rows reordered to adjacent rotary pairs, the vocabulary with token types and
merges, `tokenizer.ggml.pre = smollm`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "train" / "sample"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2-Instruct's template (as its GGUF carries it), with a system turn when none is given.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def sample_lines() -> list[str]:
    return [
        line
        for name in ("bn.txt", "en.txt")
        for line in (SAMPLE / name).read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]


def bytelevel_tokenizer(vocab_size: int = 700):
    """A byte-level BPE as SmolLM's tokenizer.json has it: Digits then ByteLevel with its regex."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample_lines(), trainer)
    return tok


def hf_folder(folder: Path, tied: bool = True, seed: int = 0) -> Path:
    """A random 2-layer Llama with a ChatML byte-level tokenizer, saved by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = bytelevel_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|endoftext|>"],  # not the end of a turn: the import must add it
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML,
    )
    fast.save_pretrained(folder)
    return folder


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a q/k weight's rows (convert_hf_to_gguf.py)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, n, *rest = hf.split(".")
    return f"blk.{n}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def write_gguf(folder: Path, path: Path, qtype: str = "F32", **changes) -> Path:
    """The GGUF of `folder` (hf_folder's), its matrices stored as `qtype` (F32, F16, Q8_0);
    `changes`: metadata to replace ("arch", "pre", "model") or tensors to add ("extra")."""
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    arch = changes.get("arch", "llama")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    tokens = [""] * cfg["vocab_size"]
    types = [gguf.TokenType.NORMAL] * cfg["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    for a in tok["added_tokens"]:
        types[a["id"]] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    w.add_tokenizer_model(changes.get("model", "gpt2"))
    w.add_tokenizer_pre(changes.get("pre", "smollm"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_eot_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, t in load_file(str(folder / "model.safetensors")).items():
        t = t.astype(np.float32)
        if name.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif name.endswith("k_proj.weight"):
            t = permute(t, kv)
        if t.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), t)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), t.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, kind), raw_dtype=kind)
    for name, t in changes.get("extra", {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
