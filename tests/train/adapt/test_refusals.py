"""What doel-train import refuses, each in one line naming what differs, with nothing written: a
model that is not Llama-shaped (another architecture, biases, another activation or rope, a head
that is not what the config says), a GGUF whose tokenizer doel does not rebuild, and a folder
that claims past doel.contracts.untrusted's bounds or leads out of itself. And its command line:
one line, an exit code, --force to replace."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from adapt.tiny_sources import hf_folder, write_gguf
from safetensors.numpy import load_file

from doel.train.adapt.importing import import_model
from doel.train.cli import main
from doel.train.common import DoelError


def quiet(_line: str) -> None:
    pass


def refused(source, out) -> str:
    with pytest.raises(DoelError) as e:
        import_model(source, out, log=quiet)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*ing")), "wrote something"
    return message


def edited(tiny_hf, tmp_path, **config):
    folder = tmp_path / "src"
    shutil.copytree(tiny_hf, folder)
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return folder


CONFIGS = {
    "model_type": ({"model_type": "mistral"}, "model_type is 'mistral', not 'llama'"),
    "architectures": ({"architectures": ["MistralForCausalLM"]}, "architectures is"),
    "biases": ({"attention_bias": True}, "attention_bias is set"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    "rope": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling is 'llama3'"),
    "head_dim": ({"head_dim": 32}, "head_dim 32 is not hidden_size 64 / 4 heads"),
    "untied": ({"tie_word_embeddings": False}, "lacks lm_head.weight (the config says the head"),
    "layers": ({"num_hidden_layers": 3}, "lacks model.layers.2."),
    "width": ({"intermediate_size": 128}, "has shape [96, 64]; the config's needs [128, 64]"),
    "bound": ({"num_hidden_layers": 2**40}, "num_hidden_layers is 1099511627776, outside"),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_a_folder_that_is_not_llama_shaped_is_refused_naming_the_difference(
    case, tiny_hf, tmp_path
):
    change, said = CONFIGS[case]
    message = refused(edited(tiny_hf, tmp_path, **change), tmp_path / "out")
    assert said in message, message


def test_a_head_that_differs_from_the_embedding_it_is_tied_to_is_refused(tmp_path):
    folder = hf_folder(tmp_path / "untied", tied=False)
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"tie_word_embeddings": True}))
    assert "ties the head to the embedding, but lm_head.weight differs" in refused(
        folder, tmp_path / "out"
    )


def test_an_untied_head_is_imported_as_its_own_tensor_from_either_form(tmp_path):
    source = hf_folder(tmp_path / "untied", tied=False)
    gguf = write_gguf(source, tmp_path / "untied.gguf")  # with llama.cpp's output.weight
    want = load_file(str(source / "model.safetensors"))["lm_head.weight"]
    for form, path in (("hf", source), ("gguf", gguf)):
        out = import_model(path, tmp_path / form, log=quiet)
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
        np.testing.assert_array_equal(
            load_file(str(out / "model.safetensors"))["lm_head.weight"], want
        )


GGUFS = {
    "architecture": ({"arch": "qwen2"}, "general.architecture is 'qwen2', not 'llama'"),
    "pre-tokenizer": ({"pre": "llama-bpe"}, "tokenizer.ggml.pre is 'llama-bpe', a split doel"),
    "sentencepiece": ({"model": "llama"}, "tokenizer.ggml.model is 'llama'"),
    "bias": (
        {"extra": {"blk.0.attn_q.bias": np.zeros(64, np.float32)}},
        "tensor blk.0.attn_q.bias is not one of a Llama",
    ),
    "rope factors": (
        {"extra": {"rope_freqs.weight": np.ones(8, np.float32)}},
        "rope_freqs.weight is rope frequency factors",
    ),
}


@pytest.mark.parametrize("case", GGUFS)
def test_a_gguf_that_is_not_a_llama_doel_rebuilds_is_refused_naming_it(case, tiny_gguf, tmp_path):
    change, said = GGUFS[case]
    message = refused(tiny_gguf(**change), tmp_path / "out")
    assert said in message, message


def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(tiny_hf, tmp_path):
    folder = edited(tiny_hf, tmp_path)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}})
    )
    message = refused(folder, tmp_path / "out")
    assert "weight_map is '../model.safetensors', not the name of a file" in message


def test_a_tokenizer_linked_from_outside_the_folder_is_refused(tiny_hf, tmp_path):
    folder = edited(tiny_hf, tmp_path)
    outside = tmp_path / "elsewhere.json"
    (folder / "tokenizer.json").rename(outside)
    (folder / "tokenizer.json").symlink_to(outside)
    assert "outside the folder" in refused(folder, tmp_path / "out")


def test_pickled_weights_are_never_loaded(tiny_hf, tmp_path):
    folder = edited(tiny_hf, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert "only pickled weights (.bin/.pt), which doel never loads" in refused(
        folder, tmp_path / "out"
    )


def test_the_command_imports_refuses_in_one_line_and_replaces_with_force(
    tiny_gguf, tmp_path, capsys
):
    out = tmp_path / "model"
    main(["import", str(tiny_gguf()), "--out", str(out)])
    assert "imported tiny-F32.gguf into" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as e:
        main(["import", str(tiny_gguf()), "--out", str(out)])
    assert (
        str(e.value) == f"error: {out} exists; pass --force to replace it, or choose another --out"
    )
    (out / "stale.txt").write_text("from before")
    main(["import", str(tiny_gguf()), "--out", str(out), "--force"])
    assert not (out / "stale.txt").exists()
    with pytest.raises(SystemExit) as e:
        main(["import", str(tmp_path / "nothing.gguf"), "--out", str(tmp_path / "o2")])
    assert str(e.value).startswith("error: ") and "no such file or folder" in str(e.value)
