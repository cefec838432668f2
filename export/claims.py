"""config.json's claims held to the tensors the weights hold, before a model is built from them.

The export builds the model (graph builder, transformers, optimum) from config.json's sizes and
only then loads the weights: a config that claims more than its tensors (a folder from a stranger,
or a config.json copied from another model) would be allocated at the size it claims, terabytes
for a few bytes, and fail minutes later if at all. So each size is checked against the tensors
that bear it out, read from the safetensors headers alone: the embedding's rows and width
(vocab_size, hidden_size), the numbered layers (num_hidden_layers), and in Llama's and GPT-2's
layouts each projection's shape (heads, KV heads, head_dim, intermediate_size). For a layout not
known here, the parameters the sizes imply must not exceed the tensors' by more than
MAX_CLAIM_RATIO. A disagreement is an ExportError naming the field and the tensor.
"""

from __future__ import annotations

import math
import re

from doel.export.common import ExportError

# The parameters config.json's sizes imply (embedding + attention + a gated feed-forward per
# layer) over those the tensors hold. Dense layouts come within ~1.4 of it (GPT-2's two-matrix
# feed-forward is the furthest); a mixture of experts holds more than it. Twice is a claim that
# is not this model's.
MAX_CLAIM_RATIO = 2
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "wte.weight")
AGAIN = "the folder's config.json is not its weights'; get the folder again from its source"


def _first(config: dict, *keys: str):
    return next((config[k] for k in keys if config.get(k) is not None), None)


def _refuse(field: str, value, tensor: str, shape, want) -> ExportError:
    return ExportError(
        f"config.json {field}={value} disagrees with the weights: tensor {tensor!r} is "
        f"{list(shape)} where {field} makes it {list(want)}; {AGAIN}"
    )


def check_claims(config: dict, shapes: dict[str, tuple[int, ...]], head_dim: int) -> None:
    """Refuse config.json sizes its tensors do not bear out (module docstring)."""
    vocab, hidden = config["vocab_size"], _first(config, "hidden_size", "n_embd")
    embedding = next((n for n in EMBEDDINGS if n in shapes), None)
    if embedding is None:
        embedding = next((n for n, s in shapes.items() if tuple(s) == (vocab, hidden)), None)
    if embedding is None:
        raise ExportError(
            f"config.json vocab_size={vocab} and hidden_size={hidden}: no tensor of the weights "
            f"is an embedding of that shape [{vocab}, {hidden}]; {AGAIN}"
        )
    shape = shapes[embedding]
    if tuple(shape) != (vocab, hidden):
        field = "vocab_size" if len(shape) != 2 or shape[0] != vocab else "hidden_size"
        raise _refuse(field, config.get(field, hidden), embedding, shape, (vocab, hidden))
    _check_layers(config, shapes)
    _check_projections(config, shapes, hidden, head_dim)
    _check_total(config, shapes, hidden, head_dim)


def _check_layers(config: dict, shapes: dict) -> None:
    """The numbered layers of the tensor names are 0 .. num_hidden_layers - 1."""
    layers = _first(config, "num_hidden_layers", "n_layer")
    if layers is None:
        return
    found = {int(m.group(1)) for n in shapes if (m := LAYER.search(n))}
    if found != set(range(layers)):
        held = f"layers 0 to {max(found)}" if found else "no numbered layers"
        field = "num_hidden_layers" if "num_hidden_layers" in config else "n_layer"
        raise ExportError(
            f"config.json {field}={layers} disagrees with the weights: their tensors hold "
            f"{held} ({len(found)} in all); {AGAIN}"
        )


def _check_projections(config: dict, shapes: dict, hidden: int, head_dim: int) -> None:
    """Llama's and GPT-2's per-layer projections have the shapes the sizes give."""
    heads = _first(config, "num_attention_heads", "n_head")
    kv = _first(config, "num_key_value_heads") or heads
    inter = _first(config, "intermediate_size", "n_inner") or 4 * hidden
    want = {  # tensor name suffix: (the field it bears out, the shape it must have)
        "self_attn.q_proj.weight": ("num_attention_heads", (heads * head_dim, hidden)),
        "self_attn.k_proj.weight": ("num_key_value_heads", (kv * head_dim, hidden)),
        "self_attn.v_proj.weight": ("num_key_value_heads", (kv * head_dim, hidden)),
        "self_attn.o_proj.weight": ("num_attention_heads", (hidden, heads * head_dim)),
        "mlp.gate_proj.weight": ("intermediate_size", (inter, hidden)),
        "mlp.up_proj.weight": ("intermediate_size", (inter, hidden)),
        "mlp.down_proj.weight": ("intermediate_size", (hidden, inter)),
        "attn.c_attn.weight": ("n_embd", (hidden, 3 * hidden)),  # GPT-2's Conv1D: [in, out]
        "mlp.c_fc.weight": ("n_inner", (hidden, inter)),
        "transformer.wpe.weight": ("n_positions", (config.get("n_positions"), hidden)),
    }
    for name, shape in shapes.items():
        for suffix, (field, need) in want.items():
            if name.endswith(suffix) and tuple(shape) != need:
                raise _refuse(field, config.get(field), name, shape, need)


def _check_total(config: dict, shapes: dict, hidden: int, head_dim: int) -> None:
    """The parameters the sizes imply are at most MAX_CLAIM_RATIO times those held."""
    heads = _first(config, "num_attention_heads", "n_head")
    kv = _first(config, "num_key_value_heads") or heads
    inter = _first(config, "intermediate_size", "n_inner") or 4 * hidden
    layers = _first(config, "num_hidden_layers", "n_layer") or 0
    attention = 2 * hidden * head_dim * (heads + kv)
    claimed = config["vocab_size"] * hidden + layers * (attention + 3 * hidden * inter)
    held = sum(math.prod(s) for s in shapes.values())
    if claimed > MAX_CLAIM_RATIO * held:
        raise ExportError(
            f"config.json's sizes (hidden_size {hidden}, intermediate_size {inter}, {layers} "
            f"layers, {heads} heads) describe {claimed:,} parameters, the weights hold "
            f"{held:,}; {AGAIN}"
        )
