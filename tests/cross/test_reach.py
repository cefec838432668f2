"""doel's folders load unchanged in the tools their users already have (issue 17, item 2):
transformers 4.x tokenizes a checkpoint's text as doel does and generates without a warning;
optimum's ORTModelForCausalLM with AutoTokenizer generates from a bundle what doel-serve
generates; onnxruntime-genai runs a bundle on ids from `tokenizers` (its own tokenizer gives
doel's ids on the default spm style, not on the doel style: tests/export/test_genai.py)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.sampling import SamplingParams
from doel.train.data.tokenizer import BOS, EOS, PAD

TEXTS = [
    "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।",
    "র\u200d্যাব এল, কি\u200cন্তু কেউ জানে না 12345",
    "The river is slow; the boat is old.",
]
NEW = 6


@pytest.fixture
def hf_warnings():
    """Warnings transformers logs (its logger does not propagate, so caplog misses them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_transformers_generates_from_a_checkpoint_with_doels_ids(
    tmp_path, tokenizer_path, tok, tiny_model_config, hf_warnings
):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from doel.train.hf import save_model
    from doel.train.model import Llama

    # A tokenizer folder written before model_input_names existed still makes a complete
    # checkpoint.
    old = tmp_path / "old-tokenizer"
    shutil.copytree(tokenizer_path.parent, old)
    conf = json.loads((old / "tokenizer_config.json").read_text(encoding="utf-8"))
    del conf["model_input_names"]
    (old / "tokenizer_config.json").write_text(json.dumps(conf), encoding="utf-8")
    torch.manual_seed(0)
    ckpt = save_model(Llama(tiny_model_config), tmp_path / "ckpt", tokenizer=old)
    assert "max_length" not in json.loads((ckpt / "generation_config.json").read_text())

    hf_tok = AutoTokenizer.from_pretrained(ckpt)
    assert type(hf_tok) is PreTrainedTokenizerFast
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    for text in TEXTS:
        enc = hf_tok(text, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        assert ids == tok.encode(text).ids and ids.count(0) == 1 and ids[0] == 0  # BOS once
        out = model.generate(**enc, max_new_tokens=5)
        assert out.shape == (1, len(ids) + 5) and out[0, : len(ids)].tolist() == ids
    assert [r.getMessage() for r in hf_warnings] == []


@pytest.fixture(scope="module")
def engine(tiny_bundle) -> Engine:
    return Engine(read_bundle(tiny_bundle), threads=1)


def serve_greedy(engine: Engine, ids: list[int]) -> tuple[list[int], np.ndarray]:
    """doel-serve's greedy continuation and the logits of each step that chose it."""
    made = list(engine.generate(ids, SamplingParams(max_tokens=NEW, temperature=0)))
    steps = [engine.forward(ids, 0)]
    steps += [engine.forward([t], len(ids) + i) for i, t in enumerate(made[:-1])]
    return made, np.stack(steps)


def test_the_bundle_carries_the_hugging_face_files(tiny_bundle):
    manifest = json.loads((tiny_bundle / "manifest.json").read_text(encoding="utf-8"))
    names = ("config.json", "tokenizer_config.json", "special_tokens_map.json")
    assert set(names + ("generation_config.json", "tokenizer.json")) <= set(manifest["files"])
    conf = json.loads((tiny_bundle / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert conf["model_input_names"] == ["input_ids", "attention_mask"]
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast"
    gen = json.loads((tiny_bundle / "generation_config.json").read_text(encoding="utf-8"))
    assert "max_length" not in gen
    assert gen["eos_token_id"] == manifest["special_tokens"]["eos"]["id"]


def test_optimum_generates_from_a_bundle_what_doel_serve_generates(tiny_bundle, tok, engine):
    ort_models = pytest.importorskip("optimum.onnxruntime")
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tiny_bundle)
    model = ort_models.ORTModelForCausalLM.from_pretrained(tiny_bundle)
    for text in TEXTS:
        enc = hf_tok(text, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        assert ids == tok.encode(text).ids
        out = model.generate(
            **enc,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        made, logits = serve_greedy(engine, ids)
        assert out.sequences[0, len(ids) :].tolist() == made
        # Every step's logits too: a random model's greedy ids repeat, and a cache fed wrongly
        # could repeat them as well.
        got = np.stack([step[0].numpy() for step in out.logits])
        assert np.abs(got - logits).max() < 1e-4 * np.abs(logits).max()


def test_onnxruntime_genai_generates_from_a_bundle_on_ids_from_tokenizers(tiny_bundle, engine):
    og = pytest.importorskip("onnxruntime_genai")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_bundle / "tokenizer.json"))
    model = og.Model(str(tiny_bundle))
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + NEW)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        steps = []
        while not generator.is_done():
            steps.append(generator.get_logits()[0, -1])
            generator.generate_next_token()
        made, logits = serve_greedy(engine, ids)
        assert list(generator.get_sequence(0))[len(ids) :] == made
        assert np.abs(np.stack(steps) - logits).max() < 1e-4 * np.abs(logits).max()


@pytest.mark.parametrize("side_files", ["old", "none"])
def test_a_bundle_of_an_older_checkpoint_gets_complete_hugging_face_files(
    tmp_path, tokenizer_path, tiny_model_config, side_files
):
    # Written before model_input_names and with max_length, or with no side files at all (a
    # folder put together by hand): the bundle's files are completed either way.
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from doel.export.bundle import hf_files
    from doel.export.checkpoint import inspect_checkpoint
    from doel.train.hf import save_model
    from doel.train.model import Llama

    folder = save_model(Llama(tiny_model_config), tmp_path / "ckpt", tokenizer=tokenizer_path)
    conf_path, gen_path = folder / "tokenizer_config.json", folder / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8"))
    gen_path.write_text(json.dumps({**gen, "max_length": 96}), encoding="utf-8")
    if side_files == "old":
        conf = json.loads(conf_path.read_text(encoding="utf-8"))
        del conf["model_input_names"]
        conf_path.write_text(json.dumps(conf), encoding="utf-8")
    else:
        conf_path.unlink()
        (folder / "special_tokens_map.json").unlink()
    out = tmp_path / "bundle"
    out.mkdir()
    hf_files(inspect_checkpoint(folder), out)

    shutil.copy(folder / "tokenizer.json", out)  # as export_checkpoint copies it
    hf_tok = AutoTokenizer.from_pretrained(out)
    text = TEXTS[1]
    assert list(hf_tok(text)) == ["input_ids", "attention_mask"]
    assert hf_tok(text)["input_ids"] == tok_ids(folder, text)
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == (BOS, EOS, PAD)
    gen_out = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    assert gen_out == gen and "max_length" not in gen_out
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()


def tok_ids(folder, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
