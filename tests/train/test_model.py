"""The model: parity with transformers both ways, config validation, presets on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.hf import load_model, save_model
from doel.train.model import Llama, ModelConfig
from doel.train.settings import TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def model_config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_our_folder_with_the_same_logits(tmp_path, tied):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ours = Llama(model_config(tie_word_embeddings=tied)).eval()
    save_model(ours, tmp_path)
    theirs = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = torch.randint(0, 300, (3, 40))
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("tied", [False, True])
def test_we_load_a_transformers_folder_with_the_same_logits(tmp_path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = model_config(tie_word_embeddings=tied)
    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    theirs = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1; make them matter for the test
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path)
    ours = load_model(tmp_path).eval()
    assert ours.config == cfg
    x = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, rtol=1e-5, atol=1e-5)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


def test_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    model = Llama(model_config())
    x = torch.randint(0, 300, (2, 16))
    y = torch.randint(0, 300, (2, 16))
    y[0, :5] = -100
    logits = model(x)
    manual = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    torch.testing.assert_close(model(x, y, reduction="sum"), manual)
    torch.testing.assert_close(model(x, y), manual / (y != -100).sum())


def test_a_broken_folder_is_refused_with_a_reason(tmp_path):
    model = Llama(model_config())
    save_model(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"hidden_act": "gelu"}))
    with pytest.raises(DoelError, match="hidden_act"):
        load_model(tmp_path)
    save_model(Llama(model_config(num_hidden_layers=1)), tmp_path / "small")
    (tmp_path / "small" / "config.json").write_text(json.dumps(cfg))  # claims 2 layers
    with pytest.raises(DoelError, match="missing tensors"):
        load_model(tmp_path / "small")
    with pytest.raises(DoelError, match="config.json"):
        load_model(tmp_path / "nothing-here")


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"hidden_size": 65}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"bos_token_id": 300}, "bos_token_id"),
    ],
)
def test_bad_model_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        model_config(**kw)


def test_presets_load_and_the_04b_model_is_sized_on_the_meta_device():
    sizes = {}
    for name in ("tiny", "small", "demo", "bangla-0.4b"):
        cfg = load_config(TrainConfig, CONFIGS / f"{name}.toml")
        with torch.device("meta"):
            model = Llama(cfg.model)
        assert all(p.is_meta for p in model.parameters())  # no memory spent
        sizes[name] = model.num_parameters()
    assert 10e6 <= sizes["small"] <= 30e6
    assert 0.35e9 <= sizes["bangla-0.4b"] <= 0.45e9
    assert sizes["tiny"] < 1e6


def test_dotted_overrides_reach_the_model_table():
    cfg = load_config(
        TrainConfig, CONFIGS / "tiny.toml", ["model.hidden_size=128", "lr=1e-4", "compile=false"]
    )
    assert cfg.model.hidden_size == 128 and cfg.lr == 1e-4 and cfg.compile is False
    with pytest.raises(DoelError, match="hidden_sise"):
        load_config(TrainConfig, CONFIGS / "tiny.toml", ["model.hidden_sise=128"])
    with pytest.raises(DoelError, match="num_key_value_heads"):
        load_config(TrainConfig, CONFIGS / "tiny.toml", ["model.num_key_value_heads=3"])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda b: b[: len(b) // 2], "tensors need"),  # cut mid-tensor (a partial copy)
        (lambda b: b[:100], "header claims"),  # cut inside the header
        (lambda b: b[:5], "shorter than a safetensors header"),
        (lambda b: b + b"\0" * 64, "tensors need"),  # bytes no tensor covers
        (lambda b: b[:8] + b"{not json" + b[17:], "not safetensors JSON"),
    ],
)
def test_a_damaged_weights_file_is_refused_naming_it(tmp_path, damage, reason):
    from doel.train.hf import read_safetensors, safetensors_problem

    save_model(Llama(model_config()), tmp_path)
    weights = tmp_path / "model.safetensors"
    assert safetensors_problem(weights) is None
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(DoelError, match=reason) as e:
        load_model(tmp_path)
    assert str(e.value).startswith(f"{weights} is truncated or damaged (") and "\n" not in str(e)
    with pytest.raises(DoelError, match="delete it"):
        read_safetensors(weights, hint="delete it")


def test_an_unreadable_config_is_refused_naming_it(tmp_path, monkeypatch):
    import errno

    save_model(Llama(model_config()), tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": 3')  # truncated
    with pytest.raises(DoelError, match="config.json"):
        load_model(tmp_path)

    def failing_read(self, *args, **kwargs):  # a disk error, or a file on a lost mount
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Path, "read_text", failing_read)
    with pytest.raises(DoelError, match=r"config.json: cannot be read \(Input/output error\)"):
        load_model(tmp_path)
