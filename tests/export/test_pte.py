"""`doel-export --format pte`: which tokenizer forms ExecuTorch's own tokenizer reads exactly (the
rules, fast), and a tiny model's program read by ExecuTorch 1.5.1 itself, in its own venv (slow;
skipped in one line where the venv cannot be had): pytorch-tokenizers' ids equal `tokenizers'` on
the sample's lines and the NFC/NFD corner cases, the program's metadata holds the stop tokens, its
greedy ids are what its LLM runner streams, and the chat prompt encodes to doel-serve's ids. The
ExecuTorch side is benchmarks/runtimes/executorch_pte.py's `probe` (imports nothing of doel)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from corners import CORNERS

from doel.export.pte import DIGIT_GPT2, runtime_tokenizer
from doel.export.tokenform import DIGIT, GPT2_SPLIT

SAMPLE = Path(__file__).resolve().parents[2] / "train" / "sample"


def _lines() -> list[str]:
    out = []
    for name in ("bn.txt", "en.txt"):
        lines = [ln for ln in (SAMPLE / name).read_text(encoding="utf-8").splitlines() if ln]
        out += lines[:100] + ["\n".join(lines[i : i + 20]) for i in range(0, 60, 20)]
    extra = ["a  1", "x 12  3", "1.5 , 2", "  7", "word\n\n9", "৩ ½ ٣ x", "abc   ১২"]
    return out + extra + CORNERS + [unicodedata.normalize("NFD", t) for t in CORNERS]


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _digits_first(tok: dict) -> dict:
    """A byte-level tokenizer.json given SmolLM2's pre-tokenizer: digits, GPT-2's regex, bytes."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    steps = [_split(DIGIT), _split(GPT2_SPLIT), byte_level | {"use_regex": False}]
    return {**tok, "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps}}


@pytest.fixture(scope="module")
def byte_level_json(tmp_path_factory, sample_paths) -> dict:
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    cfg = TokenizerConfig(vocab_size=1024, style="gguf")
    work = tmp_path_factory.mktemp("pte-gguf")
    path = train_tokenizer(resolve_sources(sample_paths), cfg, work, progress=False)
    return json.loads(Path(path).read_text(encoding="utf-8"))


def test_the_one_regex_splits_as_the_digit_split_then_gpt2s_does(byte_level_json):
    from tokenizers import Tokenizer

    original = _digits_first(byte_level_json)
    rewritten, record = runtime_tokenizer(original)
    assert record["exact"] and "rewritten" in record
    assert rewritten["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == DIGIT_GPT2
    a = Tokenizer.from_str(json.dumps(original))
    b = Tokenizer.from_str(json.dumps(rewritten))
    texts = _lines()
    assert [e.ids for e in a.encode_batch(texts)] == [e.ids for e in b.encode_batch(texts)]
    # the plain GPT-2 regex in place of DIGIT_GPT2 would cut a space run before a digit apart
    plain = Tokenizer.from_str(json.dumps(runtime_tokenizer_with(original, GPT2_SPLIT)))
    for t in ("a  1", "x 12  3"):
        assert a.pre_tokenizer.pre_tokenize_str(t) == b.pre_tokenizer.pre_tokenize_str(t)
        assert a.pre_tokenizer.pre_tokenize_str(t) != plain.pre_tokenizer.pre_tokenize_str(t)


def runtime_tokenizer_with(tok: dict, regex: str) -> dict:
    byte_level = dict(tok["pre_tokenizer"]["pretokenizers"][-1])
    return {
        **tok,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [_split(regex), byte_level]},
    }


def test_forms_the_runtime_reads_and_the_one_it_cannot(byte_level_json, tokenizer_path):
    record = runtime_tokenizer(byte_level_json)[1]
    assert record["exact"] and record["form"] == "byte-level" and "U+FFFD" in record["stream"]
    doel_style = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
    tok, record = runtime_tokenizer(doel_style)
    assert tok is doel_style and not record["exact"]
    assert "byte fallback" in record["why"] and "--style spm" in record["why"]


# ------------------------------------------------------------------ ExecuTorch itself (slow)


@pytest.fixture(scope="module")
def pte_bundle(tmp_path_factory, sample_paths, tiny_model_config) -> Path:
    """A random tiny Llama on an spm tokenizer of the sample, exported by `doel-export --format
    pte` (int4, the default) once for this module."""
    from doel.export.common import ExportError
    from doel.export.phone import runtime_python

    try:
        runtime_python("executorch")
    except ExportError as e:
        pytest.skip(str(e).split(";")[0])
    torch = pytest.importorskip("torch")
    from doel.export.cli import main
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama

    work = tmp_path_factory.mktemp("pte")
    cfg = TokenizerConfig(vocab_size=2048, style="spm")
    tok = train_tokenizer(resolve_sources(sample_paths), cfg, work / "tok", progress=False)
    torch.manual_seed(0)
    ckpt = save_model(Llama(tiny_model_config), work / "ckpt", tokenizer=tok)
    main([str(ckpt), "--out", str(work / "pte"), "--format", "pte", "--max-seq-len", "128"])
    return work / "pte"


@pytest.mark.slow
def test_executorchs_own_tokenizer_and_program_read_the_bundle(pte_bundle, tmp_path):
    from tokenizers import Tokenizer

    from benchmarks.runtimes.executorch_pte import run_probe
    from doel.serve.core.template import ChatTemplate

    manifest = json.loads((pte_bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["kind"] == "pte" and manifest["runtime_tokenizer"]["exact"]
    et = manifest["executorch"]
    assert et["add_bos"] == 1 and et["stop_ids"] == [1, 6]  # <|eos|>, <|end|>
    tok = Tokenizer.from_file(str(pte_bundle / "tokenizer.json"))
    texts = _lines()
    chats = [[{"role": "user", "content": "বাংলার রাজধানী কোথায়?"}]]
    rendered = [ChatTemplate.load(pte_bundle).render(m) for m in chats]
    prompt = tok.encode(texts[0][:60]).ids
    spec = {"tokenizer": str(pte_bundle / "tokenizer.json"), "texts": texts, "bos": 1}
    spec |= {"pte": str(pte_bundle / manifest["model"]), "plain": rendered}
    spec |= {"gen": [prompt], "want": [[-1] * 12], "prompts": [[texts[0][:60], 1]], "new": 12}
    got = run_probe(spec, tmp_path)
    want = [e.ids for e in tok.encode_batch(texts)]
    bad = [t[:30] for t, a, b in zip(texts, got["ids"], want) if a != b]
    assert not bad, f"{len(bad)} of {len(texts)} differ, first {bad[:3]}"
    assert got["eos_ids"] == [1, 6]
    assert got["plain"] == [ChatTemplate.load(pte_bundle).ids(m) for m in chats]
    # the runner (its own tokenizer and sampler, greedy) makes what the program's argmax made
    made = got["gen"][0]
    assert got["runner"][0]["made"] == len(made)
    text = tok.decode(prompt + made)[len(tok.decode(prompt)) :]
    if "\ufffd" not in text:  # a random model's bytes may be no UTF-8
        assert got["runner"][0]["text"] == text


@pytest.mark.parametrize("kind", ["pte", "litertlm"])
def test_doel_serve_refuses_a_phone_folder_in_one_line(tmp_path, kind):
    from doel.contracts.manifest import Manifest
    from doel.export.common import write_json
    from doel.serve.core.engine import BundleError, read_bundle

    record = Manifest(kind=kind, model=f"model-int4.{kind}", vocab_size=8, context_length=8)
    write_json(tmp_path / "manifest.json", record.to_dict())
    with pytest.raises(BundleError, match=f"model-int4.{kind} for a phone runtime"):
        read_bundle(tmp_path)
