"""Sample texts for evaluation (greedy and sampled continuations of a few prompts) by
incremental decoding: the prompt runs through the model once (prefill) and every new token then
attends to the keys and values cached for the positions before it, instead of running the whole
window again for each token as `Llama.generate` does.

It runs the model's own modules and weights (no second graph, no renamed parameters), so it
needs nothing outside train/; a test checks it token for token against `Llama.generate`. Serving
has its own cache in the exported graph (export/, serve/).

Shapes: B batch, T new positions, S cached positions, H query heads, K key/value heads, D head
dim, V vocab.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from doel.train.model import Block, Llama, apply_rotary

DEFAULT_PROMPTS = [
    "আমাদের গ্রামের নাম",
    "বাংলাদেশের রাজধানী ঢাকা",
    "সকালে বৃষ্টি হলে আমরা",
    "The village of Nadipara",
    "Once upon a time, in a small town by the river,",
]


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token (B, 1) from the last position's logits (B, V): the argmax when
    temperature is 0, else a draw from the top_k most likely at that temperature (the rule
    `Llama.generate` uses, so both give the same tokens)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


class KVCache:
    """Keys and values of every layer, (B, K, max_position_embeddings, D) each, filled left to
    right; `length` positions are valid."""

    def __init__(self, model: Llama, batch: int):
        cfg, p = model.config, model.lm_head.weight
        shape = (batch, cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.head_dim)
        n = cfg.num_hidden_layers
        self.k = [torch.empty(shape, device=p.device, dtype=p.dtype) for _ in range(n)]
        self.v = [torch.empty(shape, device=p.device, dtype=p.dtype) for _ in range(n)]
        self.length = 0


def _block(block: Block, x, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
    """`Block.forward` for T new positions after the cached ones, storing their keys and values.
    x: (B, T, C)."""
    a, pos = block.self_attn, cache.length
    h = block.input_layernorm(x)
    B, T, _ = h.shape
    q = a.q_proj(h).view(B, T, a.n_head, a.head_dim).transpose(1, 2)  # (B, H, T, D)
    k = a.k_proj(h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)  # (B, K, T, D)
    v = a.v_proj(h).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)  # (B, K, T, D)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    cache.k[layer][:, :, pos : pos + T] = k
    cache.v[layer][:, :, pos : pos + T] = v
    keys, values = cache.k[layer][:, :, : pos + T], cache.v[layer][:, :, : pos + T]  # (B, K, S, D)
    # The prompt (nothing cached yet) is causal within itself; one new token sees every
    # position before it and itself, so it needs no mask.
    y = F.scaled_dot_product_attention(
        q, keys, values, is_causal=pos == 0, enable_gqa=a.n_kv != a.n_head
    )  # (B, H, T, D)
    x = x + a.o_proj(y.transpose(1, 2).reshape(B, T, -1))
    return x + block.mlp(block.post_attention_layernorm(x))


def forward_cached(model: Llama, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, V) of the last of the new tokens idx (B, T), after the cache's positions:
    the whole prompt into an empty cache, or one token at a time after it."""
    pos, T = cache.length, idx.size(1)
    if pos and T != 1:
        raise ValueError("after the prompt, tokens go into the cache one at a time")
    if pos + T > model.config.max_position_embeddings:
        raise ValueError(f"{pos + T} positions exceed max_position_embeddings")
    cos, sin = model.rope_cos[pos : pos + T], model.rope_sin[pos : pos + T]  # (T, D)
    x = model.model.embed_tokens(idx)  # (B, T, C)
    for layer, block in enumerate(model.model.layers):
        x = _block(block, x, cos, sin, cache, layer)
    cache.length = pos + T
    # The head (C x V) only where the next token is read.
    return model.lm_head(model.model.norm(x[:, -1:]))[:, -1].float()  # (B, V)


@torch.no_grad()
def generate(
    model: Llama,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    on_token: Callable[[], None] | None = None,
) -> torch.Tensor:
    """`Llama.generate` with a KV cache: idx (B, T) followed by up to max_new_tokens tokens,
    stopping early once every row has produced eos_token_id. Past the model's context the
    window slides as in `Llama.generate`, which invalidates cached positions: from there each
    token is a full forward of the last max_position_embeddings tokens. `on_token()` runs after
    each token (a progress bar)."""
    limit = model.config.max_position_embeddings
    cache, pending = KVCache(model, idx.size(0)), idx  # pending: not yet in the cache
    for _ in range(max_new_tokens):
        if idx.size(1) > limit:
            logits = model(idx[:, -limit:])[:, -1, :].float()
        else:
            logits = forward_cached(model, pending, cache)
        pending = next_token(logits, temperature, top_k, generator)  # (B, 1)
        idx = torch.cat((idx, pending), dim=1)
        if on_token is not None:
            on_token()
        if eos_token_id is not None and bool((pending == eos_token_id).all()):
            break
    return idx


def continuations(
    model: Llama,
    tokenizer,
    prompts: Sequence[str] | None = None,
    max_new_tokens: int = 40,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    progress: bool = False,
) -> list[dict]:
    """Greedy and sampled continuations of each prompt (text after the prompt, specials
    dropped), decoded with the cache above. Each sample uses its own
    generator seeded with `seed`, so a prompt's sample does not depend on which prompts came
    before it. `progress`: a bar in tokens, with an ETA."""
    device = model.lm_head.weight.device
    eos = model.config.eos_token_id
    prompts = DEFAULT_PROMPTS if prompts is None else prompts
    was_training = model.training
    model.eval()
    out = []
    total = 2 * len(prompts) * max_new_tokens
    # Off with progress=False (--quiet) and whenever stderr is not a terminal (disable=None).
    tokens = tqdm(total=total, desc="sample texts", unit="tok", disable=None if progress else True)
    try:
        for prompt in prompts:
            ids = tokenizer.encode(unicodedata.normalize("NFC", prompt)).ids
            idx = torch.tensor([ids], device=device)
            new = {}
            for kind, temp in (("greedy", 0.0), ("sampled", temperature)):
                gen = torch.Generator(device=device).manual_seed(seed)
                seq = generate(
                    model, idx, max_new_tokens, temp, top_k, gen, eos, lambda: tokens.update()
                )
                tokens.update(max_new_tokens - (seq.size(1) - len(ids)))  # stopped at eos
                # Only the new tokens are decoded, so the prompt is never echoed back.
                new[kind] = tokenizer.decode(seq[0, len(ids) :].tolist(), skip_special_tokens=True)
            out.append({"prompt": prompt} | new)
    finally:
        tokens.close()
        model.train(was_training)
    return out
