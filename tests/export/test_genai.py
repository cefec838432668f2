"""onnxruntime-genai's own tokenizer and generator read a bundle of the default (spm) tokenizer as
doel does, shown by genai itself: 0.18 (the newest, in its own venv, by subprocess) and 0.15.2
(the export's builder pin, in doel's venv). The genai side is benchmarks/runtimes/genai.py's
`probe`, which imports nothing of doel. A doel-style bundle is recorded as not exact."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import pytest
from corners import CORNERS

from benchmarks.runtimes.genai import CHATS, GENAI_VENV, run_probe, serve_text

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[2] / "train" / "sample"


def _python(which: str) -> Path:
    if which == "0.18":
        if not GENAI_VENV.exists():
            pytest.skip(f"no onnxruntime-genai 0.18 venv at {GENAI_VENV}: make it with pip")
        return GENAI_VENV
    pytest.importorskip("onnxruntime_genai")
    return Path(sys.executable)


def _lines() -> list[str]:
    out = []
    for name in ("bn.txt", "en.txt"):
        lines = [ln for ln in (SAMPLE / name).read_text(encoding="utf-8").splitlines() if ln]
        out += lines[:150] + ["\n".join(lines[i : i + 20]) for i in range(0, 100, 20)]
    return out + [unicodedata.normalize("NFD", t) for t in CORNERS] + CORNERS


@pytest.fixture(scope="module")
def spm_bundles(tmp_path_factory, sample_paths, tiny_model_config) -> dict[str, Path]:
    """A random tiny Llama on an spm tokenizer of the sample, exported at int4 and int8."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxruntime_genai")
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama

    work = tmp_path_factory.mktemp("genai")
    cfg = TokenizerConfig(vocab_size=2048, style="spm")
    tok = train_tokenizer(resolve_sources(sample_paths), cfg, work / "tok", progress=False)
    torch.manual_seed(0)
    ckpt = save_model(Llama(tiny_model_config), work / "ckpt", tokenizer=tok)
    out = {}
    for q in ("int4", "int8"):
        opts = ExportOptions(quant=q, eval_tokens=64, log=lambda _m: None)
        export_checkpoint(ckpt, work / q, opts)
        out[q] = work / q
    return out


def _doel(bundle: Path):
    from tokenizers import Tokenizer

    from doel.serve.core.engine import Engine, read_bundle

    return Tokenizer.from_file(str(bundle / "tokenizer.json")), Engine(read_bundle(bundle), 1)


@pytest.mark.parametrize("which", ["0.18", "0.15.2"])
def test_genais_tokenizer_gives_tokenizers_ids_on_corner_cases_and_lines(
    spm_bundles, tmp_path, which
):
    bundle = spm_bundles["int4"]
    tok, _ = _doel(bundle)
    texts = _lines()
    got = run_probe(
        _python(which), {"bundle": str(bundle), "texts": texts, "plain": texts}, tmp_path
    )
    want = [e.ids for e in tok.encode_batch(texts)]
    assert [t for t, g, w in zip(texts, got["ids"], want) if g != w] == []
    # Without add_special_tokens (genai's default) the same ids, less <|bos|>.
    assert got["plain"] == [w[1:] for w in want]
    assert json.loads((bundle / "manifest.json").read_text())["genai_tokenizer"]["exact"] is True


@pytest.mark.parametrize("which", ["0.18", "0.15.2"])
def test_genais_stream_generator_and_chat_prompt_are_doel_serves(spm_bundles, tmp_path, which):
    from doel.serve.core.sampling import SamplingParams
    from doel.serve.core.template import ChatTemplate

    python = _python(which)
    tok, _ = _doel(spm_bundles["int4"])
    prompts = [tok.encode(t).ids for t in CORNERS[:3] + ["The river is slow"]]
    # Byte-fallback pieces: one emoji or CJK character arrives as 3-4 tokens (<|bos|> first,
    # as a prompt starts).
    spelled = [tok.encode(t).ids for t in CORNERS]
    assert any(len(s) > len(t) + 1 for s, t in zip(spelled, CORNERS) if t)
    for q, bundle in spm_bundles.items():
        _, engine = _doel(bundle)
        params = SamplingParams(max_tokens=24, temperature=0)
        made = [list(engine.generate(p, params)) for p in prompts]
        spec = {"bundle": str(bundle), "gen": prompts, "stream": made + spelled, "chat": CHATS}
        got = run_probe(python, spec, tmp_path)
        assert got["gen"] == made, q
        # doel-serve's streamed text; a random model's bytes that are no UTF-8 (U+FFFD there,
        # nothing in genai's stream) are left out.
        served = [serve_text(tok, p, m) for p, m in zip(prompts, made)]
        pairs = [(g, s) for g, s in zip(got["stream"], served) if "\ufffd" not in s]
        assert pairs and all(g == s for g, s in pairs), q
        assert got["stream"][len(made) :] == tok.decode_batch(spelled)
        chat = ChatTemplate.load(bundle)
        assert got["chat"] == [chat.render(m) for m in CHATS]
        assert got["chat_ids"] == [chat.ids(m) for m in CHATS]


def test_transformers_still_reads_the_spm_bundle_as_tokenizers(spm_bundles):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bundle = spm_bundles["int4"]
    assert (bundle / "tokenizer_module.json").exists()
    hf, (tok, _) = AutoTokenizer.from_pretrained(bundle), _doel(bundle)
    assert type(hf) is PreTrainedTokenizerFast
    texts = _lines()
    assert hf(texts)["input_ids"] == [e.ids for e in tok.encode_batch(texts)]


def test_a_doel_style_bundle_is_recorded_as_not_exact_in_genai(tiny_bundle):
    # The doel style is neither SentencePiece nor byte-level BPE: genai's tokenizer cannot give
    # its ids (Bangla as -1 ids, or an error), so the export says so and records it.
    og = pytest.importorskip("onnxruntime_genai")
    from tokenizers import Tokenizer

    record = json.loads((tiny_bundle / "manifest.json").read_text())["genai_tokenizer"]
    assert record["exact"] is False and "doel style" in record["why"]
    assert not (tiny_bundle / "tokenizer_module.json").exists()
    want = Tokenizer.from_file(str(tiny_bundle / "tokenizer.json")).encode(CORNERS[0]).ids
    tok = og.Tokenizer(og.Model(str(tiny_bundle)))
    tok.update_options(add_special_tokens="true")
    assert tok.encode(CORNERS[0]).tolist() != want


@pytest.mark.parametrize("which", ["0.18", "0.15.2"])
def test_the_gguf_styles_byte_level_bpe_needs_nothing_in_genai(
    spm_bundles, tmp_path, sample_paths, which
):
    # genai's tokenizer runs the gguf style's split regex and byte-level BPE as tokenizers does:
    # its tokenizer files in a copy of a bundle (genai's tokenizer reads only those).
    import shutil

    from tokenizers import Tokenizer

    from doel.export.genai import form
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    python = _python(which)
    cfg = TokenizerConfig(vocab_size=2048, min_frequency=1, style="gguf")
    tok = train_tokenizer(resolve_sources(sample_paths), cfg, tmp_path / "tok", progress=False)
    assert form(json.loads(tok.read_text(encoding="utf-8"))) == "byte-level"
    bundle = tmp_path / "bundle"
    shutil.copytree(spm_bundles["int4"], bundle)
    (bundle / "tokenizer_module.json").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tok.parent / name, bundle / name)
    texts = _lines()
    got = run_probe(python, {"bundle": str(bundle), "texts": texts}, tmp_path)
    want = [e.ids for e in Tokenizer.from_file(str(tok)).encode_batch(texts)]
    assert [t for t, g, w in zip(texts, got["ids"], want) if g != w] == []
