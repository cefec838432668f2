"""The Llama architecture, top-down: RMSNorm → rotary → attention → MLP → block → model (its
config, `ModelConfig`, is in train/settings.py, importable without torch).

Module and parameter names mirror Hugging Face's `LlamaForCausalLM` (`model.layers.0.self_attn.
q_proj.weight`, ...), and the rotary embedding uses the same half-split convention, so a
state dict moves between the two with no renaming or permutation (`train/hf.py` does the I/O;
tests check logits parity both ways). There is one code path: no variant branches.

Shapes: B batch, T time, C hidden size, H query heads, K key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from doel.train.settings import ModelConfig

IGNORE_INDEX = -100  # targets with this value add nothing to the loss (as in F.cross_entropy)


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in float32 whatever the input dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (max_position_embeddings, D), float32, half-split layout."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, d, 2, device=device, dtype=torch.float32) / d
    )
    t = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):
    """Rotate pairs (x[i], x[i + D/2]) by position-dependent angles. x: (B, H, T, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention: K key/value heads are shared by H/K query heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head
        )  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token ids (B, T) → logits (B, T, V), or the next-token loss when targets are given."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                "layers": nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers)),
                "norm": RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            }
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not saved in checkpoints: recomputed from the config on every load.
        cos, sin = rotary_tables(cfg, device=self.lm_head.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @property
    def tied_parameters(self) -> list[tuple[str, str]]:
        """Pairs of parameter names that must be one tensor (the gradient-flow gate checks it)."""
        if self.config.tie_word_embeddings:
            return [("model.embed_tokens.weight", "lm_head.weight")]
        return []

    @torch.no_grad()
    def reset_parameters(self):
        """Normal(0, initializer_range) weights; residual output projections scaled by
        1/sqrt(2·layers) so the residual stream's variance does not grow with depth."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.config.num_hidden_layers))
            else:
                p.normal_(0.0, std)
        cos, sin = rotary_tables(self.config, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx, targets=None, reduction: str = "mean"):
        B, T = idx.shape
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D), broadcast over (B, H)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        for block in self.model.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied matrix counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.model.embed_tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> dict:
        """Training FLOPs per token: 6 per weight of every matmul (head included, embedding
        lookup excluded) plus attention scores and values, 6·2·L·H·D·T, halved for causality."""
        cfg = self.config
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        dense = 6 * matmul
        attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
        return {"dense": dense, "attention": attention, "total": dense + attention}

    @torch.no_grad()
    def generate(
        self,
        idx,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | None = None,
    ):
        """Sample continuations of idx (B, T); greedy when temperature is 0. No KV cache: the
        plain reference that the evals' cached decoding (`doel.train.evals.generate`) is tested
        against."""
        for _ in range(max_new_tokens):
            window = idx[:, -self.config.max_position_embeddings :]
            logits = self(window)[:, -1, :].float()  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
        return idx
