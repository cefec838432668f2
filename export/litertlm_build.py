"""Run by export/litertlm.py inside LiteRT-LM's own venv (`python litertlm_build.py SPEC.json
OUT.json`): a Hugging Face Llama folder (config.json + safetensors, no pickles) -> a .litertlm
bundle, with litert-torch's own pieces only: its Edge Generative API decoder
(`model_builder.build_decoder_only_model`, configured from config.json and loaded by its loader
from the safetensors), its converter (`converter.convert_to_litert`, prefill and decode
signatures over a KV cache of `max_seq_len`) and its LiteRT-LM builder (`output_format=
"litertlm"`), which packs the TFLite model with tokenizer.json (LiteRT-LM's HuggingFace
tokenizer), the start token, the stop tokens and the Jinja chat template into LlmMetadata. It
imports nothing of doel: litert-torch pins a torch (2.14) of its own.

Quantization is the converter's: int4 = dynamic_int4_block32 (int4 weights in blocks of 32,
int8 dynamic activations), int8 = dynamic_int8 (a scale per channel), fp32 = none.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import litert_torch
import litert_torch.generative.layers.model_config as cfg
import torch
from litert_torch.generative.layers import kv_cache
from litert_torch.generative.utilities import converter, export_config, model_builder

SCHEMES = {"int4": "dynamic_int4_block32", "int8": "dynamic_int8", "fp32": "none"}
PREFILL = (32, 128)  # prefill signatures (tokens a call), each at most max_seq_len


def model_config(hf: dict, max_len: int) -> cfg.ModelConfig:
    """litert-torch's decoder config for a Hugging Face Llama config.json."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    eps = float(hf.get("rms_norm_eps", 1e-5))
    norm = cfg.NormalizationConfig(type=cfg.NormalizationType.RMS_NORM, epsilon=eps)
    attn = cfg.AttentionConfig(
        num_heads=heads,
        head_dim=head_dim,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        rotary_base=int(float(hf.get("rope_theta", 10000.0))),
        rotary_percentage=1.0,
    )
    ff = cfg.FeedForwardConfig(
        type=cfg.FeedForwardType.GATED,
        activation=cfg.ActivationConfig(cfg.ActivationType.SILU),
        intermediate_size=hf["intermediate_size"],
    )
    block = cfg.TransformerBlockConfig(
        attn_config=attn,
        ff_config=ff,
        pre_attention_norm_config=norm,
        post_attention_norm_config=norm,
    )
    return cfg.ModelConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        max_seq_len=max_len,
        embedding_dim=hf["hidden_size"],
        block_configs=block,
        final_norm_config=norm,
        lm_head_share_weight_with_embedding=bool(hf.get("tie_word_embeddings", False)),
    )


def build(spec: dict) -> dict:
    hf, max_len = spec["config"], spec["max_seq_len"]
    config = model_config(hf, max_len)
    tied = config.lm_head_share_weight_with_embedding
    names = model_builder.TENSOR_NAMES if tied else model_builder.TENSOR_NAMES_WITH_SEPARATE_LM_HEAD
    model = model_builder.build_decoder_only_model(
        checkpoint_path=spec["folder"],
        config=config,
        tensor_names=names,
        mask_cache_size=0,  # the mask is an input, as LiteRT-LM's runtime passes it
    )
    # The layout LiteRT-LM's runtime reads (Gemma 3's conversion: mask as input, cache transposed)
    layout = export_config.ExportConfig(
        mask_as_input=True, kvcache_layout=kv_cache.KV_LAYOUT_TRANSPOSED
    )
    out = Path(spec["out"])
    converter.convert_to_litert(
        model,
        output_path=str(out.parent),
        output_name_prefix=out.stem,
        prefill_seq_len=[p for p in PREFILL if p < max_len] or [max_len - 1],
        kv_cache_max_len=max_len,
        quantize=SCHEMES[spec["quant"]],
        config=config,
        export_config=layout,
        output_format="litertlm",
        hf_tokenizer_model_path=spec["tokenizer"],
        start_token_id=spec["bos_id"],
        stop_token_ids=spec["stop_ids"],
        jinja_prompt_template=spec.get("chat_template"),
        llm_model_type="generic",
    )
    made = sorted(out.parent.glob("*.litertlm"))
    if not made:
        raise SystemExit("litert-torch wrote no .litertlm file")
    if made[0] != out:
        made[0].rename(out)
    return {"litert_torch": litert_torch.__version__, "torch": torch.__version__}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    result = build(spec)
    Path(sys.argv[2]).write_text(json.dumps(result), encoding="utf-8")
