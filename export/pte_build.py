"""Run by export/pte.py inside ExecuTorch's own venv (`python pte_build.py SPEC.json`): a Hugging
Face Llama folder (config.json + safetensors, no pickles) -> model.pte for ExecuTorch's XNNPACK
backend. It imports torch, safetensors and executorch only, nothing of doel: ExecuTorch pins its
own torch and torchao, so it runs in a venv of its own, as onnxruntime-genai's newest does.

The graph is the one ExecuTorch's LLM runner drives (extension/llm/runner, `TextDecoderRunner`):
`forward(tokens [1, n], input_pos [1]) -> logits [1, n, vocab]`, the KV cache a mutable buffer
inside the program, n dynamic up to max_seq_len - 1 so a prompt is prefilled in one call. The
runner reads the program's constant methods for the rest (its constants.h): get_bos_id,
get_eos_ids (every stop token, so generation ends at the chat's end-of-turn too), get_max_seq_len,
get_max_context_len, get_vocab_size, use_kv_cache, enable_dynamic_shape.

Weights: torchao's `quantize_` through ExecuTorch's own `quantize_model_`: int4 is `8da4w` (int8
dynamic activations, int4 weights in groups of 32), the scheme of ExecuTorch's Llama examples;
int8 is `8da8w` (a scale per output row). The embedding stays float (its rows are gathered, not
multiplied); a tied head is a separate, quantized copy. The attention is plain PyTorch (the
cache written with index_copy, a mask over the whole cache), so the program needs no custom
operator an app's ExecuTorch build might lack.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from executorch.exir.capture._config import ExecutorchBackendConfig
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass
from executorch.extension.llm.export.quantize import quantize_model_
from executorch.version import __version__
from safetensors.torch import load_file
from torch import nn

SCHEMES = {"int4": ("8da4w", 32), "int8": ("8da8w", 0)}  # --quant -> (ExecuTorch config, group)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, cfg: dict, max_len: int):
        super().__init__()
        hidden, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.kv = cfg.get("num_key_value_heads") or self.heads
        self.hd = cfg.get("head_dim") or hidden // self.heads
        self.q_proj = nn.Linear(hidden, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, hidden, bias=False)
        shape = (1, self.kv, max_len, self.hd)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(self, x, pos, cos, sin, mask):
        n = x.shape[1]
        q = self.q_proj(x).view(1, n, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(1, n, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.kv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        rep = self.heads // self.kv
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(1, n, self.heads * self.hd))


def _rope(x, cos, sin):
    """Hugging Face Llama's rotation: each head's first and second halves are the pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    def __init__(self, cfg: dict, max_len: int):
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-5))
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(cfg, max_len)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, pos, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), pos, cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """forward(tokens [1, n], input_pos [1]) -> logits [1, n, vocab], the cache inside."""

    def __init__(self, cfg: dict, max_len: int):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(Layer(cfg, max_len) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-5)))
        self.lm_head = nn.Linear(hidden, cfg["vocab_size"], bias=False)
        hd = self.layers[0].self_attn.hd
        theta = float(cfg.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.register_buffer("slots", torch.arange(max_len), persistent=False)

    def forward(self, tokens, input_pos):
        n = tokens.shape[1]
        pos = input_pos + torch.arange(n, dtype=torch.long)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        allowed = self.slots[None, :] <= pos[:, None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return self.lm_head(self.norm(x))


def load(model: Llama, weights: list[str]) -> None:
    """Hugging Face names -> this module's (the MLP's three matrices sit on the layer)."""
    state = {}
    for path in weights:
        for key, t in load_file(path).items():
            key = key.removeprefix("model.").replace("mlp.", "")
            state[key] = t.float()
    if "lm_head.weight" not in state:  # tied: the head is a copy of the embedding
        state["lm_head.weight"] = state["embed_tokens.weight"].clone()
    missing, unexpected = model.load_state_dict(state, strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    if set(missing) - buffers or unexpected:
        raise SystemExit(f"weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")


def build(spec: dict) -> dict:
    torch.manual_seed(0)
    cfg, max_len = spec["config"], spec["max_seq_len"]
    model = Llama(cfg, max_len).eval()
    load(model, spec["weights"])
    if spec["quant"] in SCHEMES:
        scheme, group = SCHEMES[spec["quant"]]
        quantize_model_(model, qlinear_config=scheme, qlinear_group_size=group)
    example = (torch.tensor([[1, 2, 3]], dtype=torch.long), torch.tensor([0], dtype=torch.long))
    dims = ({1: torch.export.Dim("token_dim", max=max_len - 1)}, {0: 1})
    with torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes=dims, strict=True)
    methods = {
        "get_bos_id": spec["bos_id"],
        "get_eos_ids": spec["eos_ids"],
        "get_max_seq_len": max_len,
        "get_max_context_len": max_len,
        "get_vocab_size": cfg["vocab_size"],
        "get_n_layers": cfg["num_hidden_layers"],
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,
    }
    edge = to_edge_transform_and_lower(
        ep,
        partitioner=[XnnpackPartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
        constant_methods=methods,
    )
    program = edge.to_executorch(
        ExecutorchBackendConfig(
            extract_delegate_segments=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
        )
    )
    Path(spec["out"]).write_bytes(program.buffer)
    return {"executorch": __version__, "torch": torch.__version__, "methods": methods}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    result = build(spec)
    Path(sys.argv[2]).write_text(json.dumps(result), encoding="utf-8")
