"""What "Llama-shaped" means for an import: the architecture doel's model implements (train/
model.py) and nothing beside it. A config that names another architecture, biases, an activation
other than SiLU, a rope scaling, a head size other than hidden / heads, or a tied head whose
weights differ, is refused in one line naming what differs: a model imported anyway would run
with the difference silently dropped, giving other logits than its author's.

Every size is checked against doel.contracts.untrusted's bounds before anything is sized by it,
and each tensor's shape against the config before any is read whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from doel.contracts import untrusted
from doel.train.common import DoelError
from doel.train.settings import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
WHAT = "doel imports Llama models only (train/model.py)"


@dataclass(frozen=True)
class Source:
    """A model read from elsewhere, in doel's terms: what an import writes. `tensors` are under
    Hugging Face's names (a tied head not among them); `special` maps tokenizer_config.json's
    bos_token / eos_token / pad_token / unk_token to their text; `end_of_turn` is the token a
    chat reply ends with where it is not EOS; `source` says where it came from."""

    config: ModelConfig
    tensors: dict
    tokenizer: dict  # tokenizer.json
    tokenizer_config: dict  # the source's own fields, kept (no chat_template: that is below)
    chat_template: str | None
    generation: dict  # the source's generation_config.json, or {}
    source: dict
    end_of_turn: str | None = None
    special: dict = field(default_factory=dict)


class Refused(DoelError):
    """A source that is not Llama-shaped, or claims what no model does; one line naming it."""


def _refuse(where: str, what: str) -> Refused:
    return Refused(f"{where}: {what}; {WHAT}")


def _token_id(value, field: str, where: str) -> int | None:
    """A special token's id: an int, or the first of a list (transformers allows several EOS)."""
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    return untrusted.whole(value, f"{where} {field}", untrusted.MAX_VOCAB, least=0)


def model_config(cfg: dict, where: str) -> ModelConfig:
    """doel's ModelConfig for a Hugging Face Llama config, or Refused naming what differs."""
    if not isinstance(cfg, dict):
        raise _refuse(where, "not a JSON object")
    untrusted.sizes(cfg, untrusted.CONFIG_BOUNDS, where)
    if cfg.get("model_type") != "llama":
        raise _refuse(where, f"model_type is {cfg.get('model_type')!r}, not 'llama'")
    archs = cfg.get("architectures") or [ARCHITECTURE]
    if archs != [ARCHITECTURE]:
        raise _refuse(where, f"architectures is {archs!r}, not [{ARCHITECTURE!r}]")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse(where, f"hidden_act is {cfg['hidden_act']!r}, not 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise _refuse(where, f"{key} is set (the model has biases)")
    scaling = cfg.get("rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind not in (None, "default"):
        raise _refuse(where, f"rope_scaling is {kind!r} (doel's rotary has no scaling)")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if cfg.get("head_dim") is not None and heads and hidden and cfg["head_dim"] * heads != hidden:
        raise _refuse(
            where, f"head_dim {cfg['head_dim']} is not hidden_size {hidden} / {heads} heads"
        )
    ids = {k: _token_id(cfg.get(k), k, where) for k in ("bos_token_id", "eos_token_id")}
    ids["pad_token_id"] = _token_id(cfg.get("pad_token_id"), "pad_token_id", where)
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"]
    fields = {
        k: cfg[k]
        for k in ModelConfig.__dataclass_fields__
        if cfg.get(k) is not None and k not in ids
    }
    fields.setdefault("tie_word_embeddings", False)  # transformers' LlamaConfig default
    try:
        return ModelConfig(**fields, **{k: v for k, v in ids.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise _refuse(where, str(e)) from None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Llama of `cfg` stores, by name, with its shape."""
    c, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, c), "model.norm.weight": (c,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, c)
    per_layer = {
        "input_layernorm.weight": (c,),
        "self_attn.q_proj.weight": (q, c),
        "self_attn.k_proj.weight": (kv, c),
        "self_attn.v_proj.weight": (kv, c),
        "self_attn.o_proj.weight": (c, q),
        "post_attention_layernorm.weight": (c,),
        "mlp.gate_proj.weight": (i, c),
        "mlp.up_proj.weight": (i, c),
        "mlp.down_proj.weight": (c, i),
    }
    for n in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{n}.{k}": v for k, v in per_layer.items()})
    return shapes


def check_shapes(found: dict[str, tuple[int, ...]], cfg: ModelConfig, where: str) -> None:
    """`found` (tensor name -> shape) must be exactly the tensors of `cfg`, at their shapes. A
    stored lm_head beside a tied embedding is let through here: the caller compares the two."""
    want = expected_shapes(cfg)
    extra = sorted(set(found) - set(want) - {"lm_head.weight"})
    if extra:
        bias = next((n for n in extra if n.endswith(".bias")), None)
        what = f"{bias} is a bias" if bias else f"it holds {extra[0]}"
        raise _refuse(where, f"{what}, which a Llama has no place for")
    if "lm_head.weight" in found and "lm_head.weight" not in want:
        want = want | {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    missing = sorted(set(want) - set(found))
    if missing:
        untied = missing == ["lm_head.weight"]
        why = " (the config says the head is not tied to the embedding)" if untied else ""
        raise _refuse(where, f"it lacks {missing[0]}{why}")
    for name, shape in want.items():
        if tuple(found[name]) != shape:
            raise _refuse(
                where, f"{name} has shape {list(found[name])}; the config's needs {list(shape)}"
            )
