"""doel-train import on a tiny Llama made by its own tools (tiny_sources.py): the Hugging Face
folder transformers saved, and the GGUF written from it as llama.cpp lays one out, each give back
the source's logits, its ids on Bangla and English text, its chat prompt and its stop tokens; the
folder is then taken where RUN/final is (doel's loader, the export's checks)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from adapt.tiny_sources import CHATML, permute, sample_lines
from safetensors.numpy import load_file

from doel.contracts import checksums
from doel.train.adapt.importing import import_model

TEXTS = [
    *sample_lines()[:30],
    "২০২৪ সালে ১২৩৪৫ টাকা, 2024: 12345 taka!",
    "a  b\n\n  c\t\td   ",
    "don't we'll THEY'RE",
    "<|im_start|>user\nspelled markers<|im_end|>",
]
MESSAGES = [
    {"role": "user", "content": "বাংলায় বলো: কেমন আছ?"},
    {"role": "assistant", "content": "ভালো আছি, thanks."},
    {"role": "user", "content": "And 42 + 7?"},
]


def quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def imported(tiny_hf, tiny_gguf, tmp_path_factory):
    base = tmp_path_factory.mktemp("imported")
    return {
        "hf": import_model(tiny_hf, base / "hf", log=quiet),
        "gguf": import_model(tiny_gguf(), base / "gguf", log=quiet),
    }


def hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def source_ids(tiny_hf) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf)
    ids = tok(TEXTS[0] + " " + TEXTS[-4], add_special_tokens=False).input_ids
    return torch.tensor([ids[:100]])  # within the model's 128 positions


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_the_imported_model_gives_the_sources_logits_exactly(form, imported, tiny_hf):
    ids = source_ids(tiny_hf)
    assert ids.shape[1] > 20
    want = hf_logits(tiny_hf, ids)
    assert torch.equal(hf_logits(imported[form], ids), want)


def test_doels_own_model_reads_the_imported_folder_to_the_same_logits(imported, tiny_hf):
    from doel.train.hf import load_model

    ids = source_ids(tiny_hf)
    model = load_model(imported["gguf"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_logits(tiny_hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_the_imported_tokenizer_gives_the_sources_ids_on_bangla_and_english(
    form, imported, tiny_hf
):
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(tiny_hf)
    mine = AutoTokenizer.from_pretrained(imported[form])
    for text in TEXTS:
        want = source(text).input_ids
        assert mine(text).input_ids == want, text
        assert mine.decode(want) == text
    tok = json.loads((imported[form] / "tokenizer.json").read_text(encoding="utf-8"))
    assert tok["model"]["byte_fallback"] is False
    assert tok["decoder"]["type"] == "ByteLevel"


def test_a_gguf_tokenizer_is_the_split_llama_cpp_names(imported):
    """A GGUF names its split (`smollm`); the rebuilt tokenizer runs llama.cpp's regexes for it,
    in order, then the byte-level mapping, with no regex of its own."""
    pre = json.loads((imported["gguf"] / "tokenizer.json").read_text())["pre_tokenizer"]
    steps = pre["pretokenizers"]
    assert [s["type"] for s in steps] == ["Split", "Split", "ByteLevel"]
    assert steps[0]["pattern"] == {"Regex": r"\p{N}"}
    assert steps[2]["use_regex"] is False
    record = json.loads((imported["gguf"] / "import.json").read_text())
    assert record["source"]["tokenizer"] == {"model": "gpt2", "pre": "smollm"}


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_the_chat_template_renders_the_sources_prompt(form, imported, tiny_hf):
    from transformers import AutoTokenizer

    from doel.serve.core.template import ChatTemplate

    folder = imported[form]
    source = AutoTokenizer.from_pretrained(tiny_hf)
    mine = AutoTokenizer.from_pretrained(folder)
    kw = {"add_generation_prompt": True}
    text = source.apply_chat_template(MESSAGES, tokenize=False, **kw)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert mine.apply_chat_template(MESSAGES, tokenize=False, **kw) == text
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHATML
    assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == CHATML
    # doel-serve's renderer on the folder gives transformers' ids for the same conversation.
    want = source.apply_chat_template(MESSAGES, tokenize=True, **kw)
    assert ChatTemplate.load(folder).ids(MESSAGES) == list(want)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_the_stop_tokens_are_eos_and_the_end_of_turn(form, imported, tiny_hf):
    source = json.loads((tiny_hf / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in source["added_tokens"]}
    folder = imported[form]
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids["<|im_end|>"]]
    assert gen["bos_token_id"] == ids["<|im_start|>"]
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == ids["<|endoftext|>"]
    assert config["max_position_embeddings"] == 128
    assert config["tie_word_embeddings"] is True
    specials = json.loads((folder / "special_tokens_map.json").read_text())
    assert specials["eos_token"] == "<|endoftext|>" and specials["bos_token"] == "<|im_start|>"


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_a_gguf_matrix_is_read_as_the_numbers_its_type_stores(qtype, tiny_gguf, tiny_hf, tmp_path):
    """F16 and Q8_0 matrices come back as gguf's dequantization of what was written, the q/k
    rows in Hugging Face's order again (llama.cpp's reordering applied to them gives the file's)."""
    out = import_model(tiny_gguf(qtype), tmp_path / "m", log=quiet)
    got = load_file(str(out / "model.safetensors"))
    src = load_file(str(tiny_hf / "model.safetensors"))
    kind = gguf.GGMLQuantizationType[qtype]
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w = src[name].astype(np.float32)
        w = permute(w, 4) if "q_proj" in name else w
        if qtype == "F16":
            stored = w.astype(np.float16).astype(np.float32)
        else:
            stored = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(w.shape)
        back = permute(got[name], 4) if "q_proj" in name else got[name]
        assert back.dtype == np.float32
        np.testing.assert_array_equal(back, stored)
        assert not np.array_equal(back, w)  # the type's rounding is there: not the source


def test_the_imported_folder_passes_the_exports_checks_with_its_checksums(imported):
    from doel.export.checkpoint import inspect_checkpoint

    ckpt = inspect_checkpoint(imported["gguf"])
    assert set(ckpt.hashes) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert ckpt.special_tokens["eos"]["token"] == "<|endoftext|>"
    assert ckpt.context_length == 128
    assert checksums.verify(imported["hf"])  # every file it wrote is recorded


def test_the_folder_keeps_the_umask(imported):
    modes = {p.name: p.stat().st_mode & 0o777 for p in imported["gguf"].iterdir()}
    assert len(set(modes.values())) == 1, modes  # safetensors' own 0600 is not kept


def test_the_record_keeps_the_sources_license_from_its_card(tiny_hf, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_hf, src)
    card = "---\nlanguage: [en]\nlicense: 'apache-2.0'\n---\n# A model\nlicense: not this one\n"
    (src / "README.md").write_text(card, encoding="utf-8")
    record = json.loads(
        (import_model(src, tmp_path / "out", log=quiet) / "import.json").read_text()
    )
    assert record["source"]["license"] == "apache-2.0"
    (src / "README.md").write_text("# A model\n\nlicense: mit\n", encoding="utf-8")  # no metadata
    out = import_model(src, tmp_path / "o2", log=quiet)
    assert json.loads((out / "import.json").read_text())["source"]["license"] is None
