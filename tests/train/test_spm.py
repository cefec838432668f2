"""The "spm" tokenizer style (SentencePiece BPE, train/data/spm.py) and its GGUF: the exact
vocabulary size with doel's special-token and byte ids, every text encoding and decoding back,
the tokenizer.json form the GGUF export accepts and writes as llama.cpp's SentencePiece
vocabulary; with llama-cpp-python installed, llama.cpp gives `tokenizers`' ids on generated text
full of Bangla corner cases, f32 logits equal to PyTorch's, and the chat prompt doel-serve
builds."""

from __future__ import annotations

import json
import random
import unicodedata

import numpy as np
import pytest

from doel.train.data.textio import resolve_sources
from doel.train.data.tokenizer import (
    BYTE_TOKENS,
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    TokenizerConfig,
    load_tokenizer,
    train_tokenizer,
)

# Pieces of Bangla that tokenizers get wrong: vowel signs, virama clusters, the nukta letters
# composed (U+09DC, U+09DD, U+09DF) and as base + nukta, ra + virama + ya with ZWJ and ZWNJ,
# Bengali digits, dandas; and around them emoji, CJK, Latin, tabs, space runs and newlines.
BANGLA = [
    "কা", "কি", "কী", "কু", "কূ", "কৃ", "কে", "কৈ", "কো", "কৌ", "ক্ষ", "জ্ঞ", "স্ত্র", "ং", "ঃ", "ঁ",
    "\u09dc", "\u09dd", "\u09df", "ড\u09bc", "ঢ\u09bc", "য\u09bc", "র\u200d্য", "র\u200c্য",
    "ক্\u200cত", "১২৩", "৪৫৬৭৮৯০", "।", "॥", "আমার", "সোনার", "বাংলা", "ভালোবাসি", "ৎ", "ৗ",
]  # fmt: skip
OTHER = [
    "🙂",
    "👍🏽",
    "漢字",
    "日本語",
    "émigré",
    "don't",
    "3.14",
    "12345",
    "<|eos|>",
    "<0x41>",
    "▁",
]
GAPS = [" ", "  ", "   ", "\t", " \t ", "\n", "\n\n", "\n  \n", "", ", ", "। ", "\r\n"]


def generated_texts(n: int = 200, seed: int = 0) -> list[str]:
    """n strings of random Bangla pieces, other scripts and whitespace, some with leading or
    trailing whitespace (where a SentencePiece-style tokenizer is most fragile)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [
            rng.choice(BANGLA if rng.random() < 0.7 else OTHER) for _ in range(rng.randint(1, 12))
        ]
        text = "".join(p + rng.choice(GAPS) for p in parts)
        out.append(rng.choice(["", " ", "  ", "\n", "\t"]) + text)
    return out


def _checkpoint(folder, tokenizer, cfg):
    """A random model of `cfg` saved with `tokenizer` (its side files, the template included)."""
    import torch

    from doel.train.hf import save_model
    from doel.train.model import Llama

    torch.manual_seed(0)
    model = Llama(cfg).eval()
    return save_model(model, folder, tokenizer=tokenizer), model


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory, sample_paths):
    cfg = TokenizerConfig(vocab_size=2048, style="spm")
    out = tmp_path_factory.mktemp("spm-tok")
    return train_tokenizer(resolve_sources(sample_paths), cfg, out, progress=False)


def test_spm_style_keeps_doels_ids_and_the_exact_size(spm_tokenizer, tokenizer_path):
    tok, doel = load_tokenizer(spm_tokenizer), load_tokenizer(tokenizer_path)
    assert tok.get_vocab_size() == 2048
    for t in [*SPECIAL_TOKENS, *BYTE_TOKENS, *CHAT_TOKENS]:
        assert tok.token_to_id(t) == doel.token_to_id(t), t
    data = json.loads(spm_tokenizer.read_text(encoding="utf-8"))
    assert data["pre_tokenizer"] is None and data["model"]["byte_fallback"] is True
    side = json.loads((spm_tokenizer.parent / "tokenizer_config.json").read_text())
    assert "chat_template" in side and side["bos_token"] == "<|bos|>"


def test_every_text_encodes_and_decodes_back(spm_tokenizer):
    tok = load_tokenizer(spm_tokenizer)
    for text in generated_texts():
        enc = tok.encode(text)
        assert enc.ids[0] == tok.token_to_id("<|bos|>")
        assert tok.token_to_id("<|eos|>") not in enc.ids  # spelled specials stay text
        want = text.replace("▁", " ")  # SentencePiece's space symbol decodes as a space
        assert tok.decode(enc.ids) == want, repr(text)


def test_spm_style_learns_whole_bengali_units(spm_tokenizer):
    tok = load_tokenizer(spm_tokenizer)
    text = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।"
    assert len(tok.encode(text).ids) < len(text) / 2
    assert not [t for t in tok.encode(text).tokens if t.startswith("<0x")]


def test_nfc_text_trains_on_what_prepare_gives_the_model(tmp_path):
    # য় (U+09DF) has no NFC form of its own: NFC text spells it ya + nukta.
    text = tmp_path / "t.txt"
    text.write_text(("\u09df\u09be\u09df\u09c7 আমার " * 200 + "\n") * 5, encoding="utf-8")
    got = {}
    for nfc in (True, False):
        cfg = TokenizerConfig(vocab_size=600, style="spm", nfc_text=nfc)
        path = train_tokenizer(resolve_sources([str(text)]), cfg, tmp_path / str(nfc), log=print)
        got[nfc] = set(json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"])
    assert any("য\u09bc" in t for t in got[True]) and not any("\u09df" in t for t in got[True])
    assert any("\u09df" in t for t in got[False])
    assert unicodedata.normalize("NFC", "\u09df") == "য\u09bc"


def test_a_small_corpus_is_padded_to_the_size_asked(tmp_path, sample_paths):
    cfg = TokenizerConfig(vocab_size=20000, style="spm")
    path = train_tokenizer(resolve_sources(sample_paths), cfg, tmp_path, log=lambda _m: None)
    record = json.loads((tmp_path / "doel_tokenizer.json").read_text())
    assert load_tokenizer(path).get_vocab_size() == 20000 > record["learned_tokens"]


def test_gguf_of_an_spm_tokenizer_is_llama_cpps_sentencepiece_vocabulary(
    tmp_path, spm_tokenizer, tiny_model_config
):
    gguf = pytest.importorskip("gguf")
    from doel.export.gguf import export_gguf

    ckpt, _ = _checkpoint(tmp_path / "ckpt", spm_tokenizer, tiny_model_config)
    result = export_gguf(ckpt, tmp_path / "g", "q8_0", log=lambda _m: None)
    assert result["pre_tokenizer"] == "llama"
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model-q8_0.gguf"))
    field = reader.fields
    model = bytes(field["tokenizer.ggml.model"].parts[-1]).decode()
    assert model == "llama" and "tokenizer.ggml.merges" not in field
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in field["tokenizer.ggml.tokens"].data]  # fmt: skip
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0])
             for i in field["tokenizer.ggml.token_type"].data]  # fmt: skip
    scores = [float(field["tokenizer.ggml.scores"].parts[i][0])
              for i in field["tokenizer.ggml.scores"].data]  # fmt: skip
    vocab = json.loads(spm_tokenizer.read_text(encoding="utf-8"))["model"]["vocab"]
    assert all(tokens[i] == t for t, i in vocab.items())
    assert types[vocab["<|bos|>"]] == 3 and types[vocab["<0x41>"]] == 6
    learned = [i for t, i in vocab.items() if types[i] == 1]
    assert sorted(learned, key=lambda i: -scores[i]) == sorted(learned)  # earlier, higher
    assert bool(field["tokenizer.ggml.add_space_prefix"].parts[-1][0]) is True
    card = (tmp_path / "g" / "README.md").read_text()
    assert "SentencePiece" in card and "--style spm" in card


def test_llama_cpp_matches_tokenizers_on_bangla_corner_cases_and_the_chat_prompt(
    tmp_path, spm_tokenizer, tiny_model_config
):
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama-cpp-python is a benchmark-only dependency, built from source "
        "(benchmarks/serve/bench_serve_llama.py install_llama_cpp); CI does not build it",
    )
    torch = pytest.importorskip("torch")
    from doel.export.gguf import export_gguf
    from doel.serve.core.template import ChatTemplate

    ckpt, model = _checkpoint(tmp_path / "ckpt", spm_tokenizer, tiny_model_config)
    export_gguf(ckpt, tmp_path / "g", "f32", log=lambda _m: None)
    llm = llama_cpp.Llama(  # type_k/type_v 0: an f32 KV cache
        str(tmp_path / "g" / "model-f32.gguf"), n_ctx=96, logits_all=True, verbose=False,
        type_k=0, type_v=0,
    )  # fmt: skip
    tok = load_tokenizer(spm_tokenizer)
    texts = generated_texts()
    texts.append("\n".join(texts[:20]))
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == tok.encode(text).ids
    ids = tok.encode(texts[0] + texts[1]).ids[:96]
    llm.reset()
    llm.eval(ids)
    ours = np.array(llm.scores[: len(ids)], dtype=np.float64)
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].double().numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
    seen = []
    real = llm.tokenize
    llm.tokenize = lambda text, add_bos=True, special=False: (
        seen.append(real(text, add_bos=add_bos, special=special)) or seen[-1]
    )
    messages = [
        {"role": "system", "content": "তুমি সহায়ক।"},
        {"role": "user", "content": " আমার\tসোনার বাংলা?\n\nAnd  English 🙂"},
    ]
    llm.create_chat_completion(messages=messages, max_tokens=1, temperature=0.0)
    assert seen[0] == ChatTemplate.load(ckpt).ids(messages)


def test_text_that_spells_sentencepieces_unknown_piece_still_merges(tmp_path):
    # Wikipedia dumps spell "<unk>"; SentencePiece never merges the spelling of its own unknown
    # piece, so the style names that piece what no text spells.
    text = tmp_path / "w.txt"
    text.write_text("the <unk> was <unk> and <unk>\n" * 300, encoding="utf-8")
    cfg = TokenizerConfig(vocab_size=600, style="spm")
    path = train_tokenizer(resolve_sources([str(text)]), cfg, tmp_path / "t", log=lambda _m: None)
    assert len(load_tokenizer(path).encode("<unk>", add_special_tokens=False).ids) == 1


def test_doel_train_tokenizer_without_a_style_trains_spm_and_the_recipe_names_it(
    tmp_path, sample_paths
):
    from doel.export.gguf import llama_cpp_pre_type
    from doel.pipeline.spec import load_recipe, resolve_recipe
    from doel.train.cli import main

    main(["tokenizer", "--data", *sample_paths, "--vocab-size", "1024", "--out", str(tmp_path)]
         + ["--quiet"])  # fmt: skip
    path = tmp_path / "tokenizer.json"
    assert llama_cpp_pre_type(json.loads(path.read_text(encoding="utf-8")), path) == "llama"
    saved = json.loads((tmp_path / "doel_tokenizer.json").read_text())
    assert saved["config"]["style"] == "spm" == TokenizerConfig().style
    assert load_recipe(resolve_recipe("bangla-0.4b")).tokenizer.style == "spm"
