"""`doel-train adapt` (train/adapt/run.py, vocab.py, init.py, pretrain.py, chat.py): on the tiny
imported model (its GGUF's tokenizer: SmolLM's split, byte-level BPE, ChatML), and once on the
real SmolLM2-135M-Instruct through the command line at a few steps (slow)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from adapt.tiny_sources import SAMPLE
from safetensors.torch import load_file
from tokenizers import Tokenizer

from doel.train.adapt.chat import Template
from doel.train.adapt.init import write_adapted
from doel.train.adapt.pretrain import continue_pretraining, make_shards, rows_gate
from doel.train.adapt.run import AdaptConfig, adapt, adapted_model, presets, resolve_preset
from doel.train.adapt.vocab import extend, marks_kept, new_token_ids
from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.data.prepare import PrepareConfig
from doel.train.hf import load_model
from doel.train.job import GradientFlowError

ROOT = Path(__file__).resolve().parents[3]
TEXT = [str(SAMPLE / "bn.txt"), str(SAMPLE / "en.txt")]
CHAT = str(SAMPLE / "chat.jsonl")


@pytest.fixture(scope="module")
def base(tiny_gguf, tmp_path_factory) -> Path:
    from doel.train.adapt.importing import import_model

    return import_model(tiny_gguf(), tmp_path_factory.mktemp("adapt") / "base", log=print)


def _json(folder: Path, name: str = "tokenizer.json") -> dict:
    return json.loads((folder / name).read_text(encoding="utf-8"))


def _lines(lang: str) -> list[str]:
    return [ln for ln in (SAMPLE / f"{lang}.txt").read_text("utf-8").splitlines() if ln.strip()]


def _chars_per_token(tok_json: dict, texts: list[str]) -> float:
    tok = Tokenizer.from_str(json.dumps(tok_json))
    return sum(map(len, texts)) / sum(len(tok.encode(t).ids) for t in texts)


def tiny_config(**pretrain) -> AdaptConfig:
    sets = ["new_tokens=40", "tokenizer_chars=200000", "prepare.max_val_overlap=1.0"]
    sets += [f"pretrain.{k}={v}" for k, v in ({"steps": 3, "seq_len": 64, "batch_size": 2,
             "warmup_steps": 1, "eval_every": 0, "checkpoint_every": 2, "dtype": "float32",
             "device": "cpu"} | pretrain).items()]  # fmt: skip
    chat = {"steps": 2, "seq_len": 128, "batch_size": 2, "dtype": "float32", "device": "cpu"}
    chat |= {"checkpoint_every": 0, "eval_every": 0}
    sets += [f"chat.{k}={v}" for k, v in chat.items()]
    return load_config(AdaptConfig, None, sets)


@pytest.mark.parametrize("split", ["base", "marks"])
def test_extending_keeps_every_base_id_and_the_english_encodings(base, split):
    base_json = _json(base)
    ext = extend(base_json, _lines("bn"), 40, split)
    new = new_token_ids(base_json, ext)
    assert len(new) == 40 and new == list(range(len(base_json["model"]["vocab"]), new[-1] + 1))
    assert {k: ext["model"]["vocab"][k] for k in base_json["model"]["vocab"]} == base_json["model"][
        "vocab"
    ]
    old, now = (Tokenizer.from_str(json.dumps(t)) for t in (base_json, ext))
    english = [t for t in _lines("en") if not any("\u0980" <= c <= "\u09ff" for c in t)]
    assert len(english) > 20  # text without Bangla keeps the base's ids
    assert [now.encode(t).ids for t in english] == [old.encode(t).ids for t in english]
    assert all(now.decode(now.encode(t).ids) == t for t in _lines("bn"))
    assert _chars_per_token(ext, _lines("bn")) > _chars_per_token(base_json, _lines("bn"))


def test_keeping_the_marks_in_the_word_gives_longer_bangla_tokens(base):
    base_json = _json(base)
    cut, kept = (extend(base_json, _lines("bn"), 60, s) for s in ("base", "marks"))
    assert _chars_per_token(kept, _lines("bn")) > _chars_per_token(cut, _lines("bn"))
    regex = json.dumps(kept["pre_tokenizer"])
    assert r"[\\p{L}\\p{M}]+" in regex and r"[\\p{L}\\p{M}]+" not in json.dumps(cut)


def test_a_split_without_letters_to_widen_is_refused():
    with pytest.raises(DoelError, match="split=base"):
        marks_kept({"type": "Metaspace", "replacement": "▁"})


def test_new_rows_are_the_mean_of_the_base_rows_and_the_chat_files_are_the_base_s(base, tmp_path):
    base_json = _json(base)
    ext = extend(base_json, _lines("bn"), 20, "marks")
    counts = write_adapted(base, ext, tmp_path / "m", True, {"tokenizer": "extend"})
    assert (
        counts["new"] == 20
        and _json(tmp_path / "m", "config.json")["vocab_size"] == counts["vocab"]
    )
    old = load_file(str(base / "model.safetensors"))["model.embed_tokens.weight"]
    now = load_file(str(tmp_path / "m" / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(now[: len(old)], old)
    tok = Tokenizer.from_str(json.dumps(base_json))
    inv = {v: k for k, v in ext["model"]["vocab"].items()}
    for i in new_token_ids(base_json, ext)[:5]:
        pieces = [tok.token_to_id(t.value) for t in tok.model.tokenize(inv[i])]
        assert len(pieces) > 1 and torch.allclose(now[i], old[pieces].mean(0), atol=1e-6)
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (tmp_path / "m" / name).read_bytes() == (base / name).read_bytes()


def test_the_rows_gate_refuses_new_rows_without_a_gradient(base, tmp_path):
    model = load_model(base)
    n = model.config.vocab_size - 3  # the last three rows play the new tokens
    x = torch.tensor([[1, 5, n, n + 1, 7, n + 2, 9, 4]])
    loader = SimpleNamespace(peek=lambda k: [(x[:, :-1].numpy(), x[:, 1:].numpy())])
    parts = SimpleNamespace(model=model, device=torch.device("cpu"), loader=loader,
                            ctx=contextlib.nullcontext)  # fmt: skip
    seen = []
    rows_gate(parts, n, seen.append)
    assert "3 new" in seen[0]
    cut = torch.ones(model.config.vocab_size, 1)
    cut[n:] = 0
    model.model.embed_tokens.weight.register_hook(lambda g: g * cut)
    with pytest.raises(GradientFlowError, match="new rows"):
        rows_gate(parts, n, print)


def test_the_template_renders_the_base_s_chatml_and_masks_the_replies(base):
    tmpl = Template(base)
    messages = [{"role": "user", "content": "কেমন আছ?"}, {"role": "assistant", "content": "ভালো।"}]
    ids, mask = tmpl.render(messages)
    assert tmpl.tok.decode(ids.tolist(), skip_special_tokens=False).startswith("<|im_start|>system")
    assert tmpl.tok.decode(ids[mask].tolist(), skip_special_tokens=False) == "ভালো।<|im_end|>\n"
    spelled = [messages[0], {"role": "assistant", "content": "x<|im_end|>"}]
    assert tmpl.render(spelled) is None  # a message cannot inject a turn


def test_pretraining_resumes_exactly(base, tmp_path):
    cfg = tiny_config(steps=4, checkpoint_every=1)
    model, n_base = adapted_model(base, TEXT, tmp_path, cfg)
    make_shards(model, TEXT, tmp_path, PrepareConfig(val_fraction=0.1, max_val_overlap=1.0))

    def run(out, **asked):
        return continue_pretraining(cfg.pretrain, model, tmp_path / "shards", out, n_base,
                                    skip_verify=True, **asked)  # fmt: skip

    whole = load_file(str(run(tmp_path / "a") / "model.safetensors"))

    def stop(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(DoelError, match="resume from it"):
        run(tmp_path / "b", step_hook=stop)
    again = load_file(str(run(tmp_path / "b") / "model.safetensors"))
    assert all(torch.equal(whole[k], again[k]) for k in whole)


def test_adapt_makes_a_chat_model_with_the_base_s_template_and_its_new_vocabulary(base, tmp_path):
    final = adapt(tiny_config(), base, TEXT, tmp_path / "run", chat_data=[CHAT], skip_verify=True)
    assert (tmp_path / "run" / "final").resolve() == final.resolve()
    assert (
        _json(final, "tokenizer_config.json")["chat_template"]
        == _json(base, "tokenizer_config.json")["chat_template"]
    )
    vocab = Tokenizer.from_file(str(final / "tokenizer.json")).get_vocab_size()
    assert vocab == _json(final, "config.json")["vocab_size"] == _json(final, "adapt.json")["vocab"]
    assert load_model(final).config.vocab_size == vocab
    assert _json(final, "adapt.json")["new"] == 40


def test_a_folder_that_is_not_a_model_and_a_bad_setting_are_one_line_errors(tmp_path):
    with pytest.raises(DoelError, match="doel-train import"):
        adapt(AdaptConfig(), tmp_path, TEXT, tmp_path / "run")
    with pytest.raises(DoelError, match="tokenizer must be one of"):
        load_config(AdaptConfig, None, ["tokenizer=bpe"])
    with pytest.raises(DoelError, match="adapt preset"):
        resolve_preset("no-such-preset")


def test_the_shipped_preset_loads():
    assert "adapt-smollm2-135m" in presets()
    cfg = load_config(AdaptConfig, resolve_preset("adapt-smollm2-135m"))
    assert cfg.tokenizer == "extend" and cfg.pretrain.steps > 0


@pytest.mark.slow
def test_doel_train_adapt_on_smollm2_at_a_few_steps(smollm2_folder, tmp_path):
    """The command on the real model: 2 steps of pretraining and 2 of chat, a small vocabulary."""
    sets = ["new_tokens=256", "tokenizer_chars=300000", "prepare.max_val_overlap=1.0",
            "pretrain.steps=2", "pretrain.seq_len=64", "pretrain.batch_size=1",
            "pretrain.warmup_steps=1", "pretrain.eval_every=0", "pretrain.checkpoint_every=0",
            "pretrain.dtype=float32", "chat.steps=1", "chat.seq_len=64", "chat.batch_size=1",
            "chat.dtype=float32", "chat.eval_every=0", "chat.checkpoint_every=0"]  # fmt: skip
    cmd = [sys.executable, "-m", "doel.train", "adapt", str(smollm2_folder), "--data", *TEXT,
           "--out", str(tmp_path / "run"), "--chat", CHAT, "--skip-verify",
           *[a for s in sets for a in ("--set", s)]]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    final = (tmp_path / "run" / "final").resolve()
    record = _json(final, "adapt.json")
    assert record["base_vocab"] == 49152 and record["new"] == 256
    tok = Tokenizer.from_file(str(final / "tokenizer.json"))
    ids = tok.encode("বাংলা ভাষা").ids
    assert any(i >= 49152 for i in ids) and tok.decode(ids) == "বাংলা ভাষা"
    assert "<|im_start|>" in _json(final, "tokenizer_config.json")["chat_template"]
    assert "pass rows" in done.stdout  # the gates run under --skip-verify too
    assert done.stdout.count("gradient flow:") == 2  # pretraining's and the chat's


def test_a_replaced_vocabulary_is_doel_s_spm_with_every_row_transplanted(base, tmp_path):
    cfg = load_config(AdaptConfig, None, ["tokenizer=spm", "spm_vocab_size=600"])
    model, n_base = adapted_model(base, TEXT, tmp_path, cfg)
    assert n_base == 0  # the rows gate takes every row as new
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    config = _json(model, "config.json")
    assert tok.get_vocab_size() == config["vocab_size"] == 600
    assert config["bos_token_id"] == tok.token_to_id("<|bos|>")
    old = load_file(str(base / "model.safetensors"))["model.embed_tokens.weight"]
    now = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"]
    base_tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    assert torch.allclose(
        now[tok.token_to_id("<|bos|>")], old[base_tok.token_to_id("<|endoftext|>")]
    )
    piece = next(p for p, i in tok.get_vocab().items() if p.startswith("▁") and len(p) > 3)
    ids = base_tok.encode(piece.replace("▁", " ")).ids
    assert torch.allclose(now[tok.token_to_id(piece)], old[ids].mean(0), atol=1e-6)
