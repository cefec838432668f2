"""The "gguf" tokenizer style and `doel-export --format gguf`: the style tokenizes into the same
units as the character-level BPE it was trained as; the export refuses a tokenizer llama.cpp
cannot reproduce and writes a GGUF whose metadata, vocabulary and tensors read back as written;
with llama-cpp-python installed, llama.cpp tokenizes id for id as `tokenizers` and its f32 logits
equal PyTorch's."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from doel.train.data.bytelevel import byte_chars
from doel.train.data.textio import resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

TEXTS = [
    "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।",
    "চিরদিন তোমার আকাশ, তোমার বাতাস, আমার প্রাণে ওমা আমার প্রাণে বাজায় বাঁশি॥",
    "র‍্যাব ও রেফ: ক্ষ, জ্ঞ, ড়, ঢ়, য়; ১২৩৪৫ টাকা — ‘উদ্ধৃতি’ “কথা”…",
    "The quick brown fox didn't jump over 12345 lazy dogs; it's 3.14 o'clock.\n\n  Indented\tline",
    "mixed বাংলা and English, 漢字, émigré, 𝔸 emoji 🙂 <|eos|> <0x41>",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory, sample_paths):
    """The sample's "gguf"-style tokenizer, and its character-level form before re-spelling."""
    import doel.train.data.tokenizer as tokmod

    seen = {}
    real = tokmod.respell_byte_level

    def spy(data, size):
        seen["before"] = copy.deepcopy(data)
        seen["dropped"] = real(data, size)
        return seen["dropped"]

    tokmod.respell_byte_level = spy
    try:
        cfg = TokenizerConfig(vocab_size=2048, min_frequency=1, style="gguf")
        out = tmp_path_factory.mktemp("gguf-tok")
        path = train_tokenizer(resolve_sources(sample_paths), cfg, out, progress=False)
    finally:
        tokmod.respell_byte_level = real
    return path, seen["before"], seen["dropped"]


def test_gguf_style_tokenizes_into_the_units_of_its_character_level_bpe(gguf_tokenizer):
    from tokenizers import Tokenizer

    path, before, dropped = gguf_tokenizer
    chars = load_tokenizer(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert chars.get_vocab_size() == 2048 and data["normalizer"] is None
    assert data["model"]["byte_fallback"] is False
    before["model"]["merges"] = before["model"]["merges"][
        : len(before["model"]["merges"]) - dropped
    ]
    reference = Tokenizer.from_str(json.dumps(before))
    reference.encode_special_tokens = True
    back = {c: b for b, c in enumerate(byte_chars())}
    for text in TEXTS:
        enc, ref = chars.encode(text), reference.encode(text)
        assert chars.decode(enc.ids) == text  # no normalizer: every text comes back as it was
        ours = [t.encode() if t == "<|bos|>" else bytes(back[c] for c in t) for t in enc.tokens]
        theirs = [
            bytes([int(t[3:5], 16)]) if t.startswith("<0x") and len(t) == 6 else t.encode()
            for t in ref.tokens
        ]
        assert ours == theirs, text
    bangla = chars.encode(TEXTS[0]).tokens
    assert len(bangla) < len(TEXTS[0]) / 2  # whole Bengali units, not bytes


def _checkpoint(folder, tokenizer, cfg, chat_template=None):
    """A random model of `cfg` (conftest's tiny_model_config) saved with `tokenizer`."""
    from doel.train.hf import save_model
    from doel.train.model import Llama

    torch.manual_seed(0)
    model = Llama(cfg)
    ckpt = save_model(model, folder, tokenizer=tokenizer)
    if chat_template:
        side = ckpt / "tokenizer_config.json"
        side.write_text(
            json.dumps({**json.loads(side.read_text()), "chat_template": chat_template})
        )
    return ckpt, model


def test_a_tokenizer_llama_cpp_cannot_reproduce_is_refused_in_one_line(
    tmp_path, tokenizer_path, tiny_model_config, capsys
):
    from doel.export.cli import main

    ckpt, _ = _checkpoint(tmp_path / "ckpt", tokenizer_path, tiny_model_config)  # doel's style
    with pytest.raises(SystemExit) as e:
        main([str(ckpt), "--out", str(tmp_path / "g"), "--format", "gguf", "--quant", "f32"])
    msg = str(e.value.code)
    assert "\n" not in msg and "byte fallback" in msg and "--style gguf" in msg
    assert not (tmp_path / "g").exists()  # nothing written


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0", "q4_0"])
def test_gguf_reads_back_with_tokenizer_metadata_and_tensors(
    tmp_path, gguf_tokenizer, tiny_model_config, quant
):
    from doel.export.cli import main

    path = gguf_tokenizer[0]
    ckpt, model = _checkpoint(
        tmp_path / "ckpt", path, tiny_model_config, chat_template="{{ messages }}"
    )
    main([str(ckpt), "--out", str(tmp_path / "g"), "--format", "gguf", "--quant", quant])
    out = tmp_path / "g"
    assert sorted(p.name for p in out.iterdir()) == [
        "Modelfile",
        "README.md",  # the model card (tests/export/test_publish.py)
        "manifest.json",
        f"model-{quant}.gguf",
    ]
    assert f"FROM ./model-{quant}.gguf" in (out / "Modelfile").read_text()
    reader = gguf.GGUFReader(str(out / f"model-{quant}.gguf"))
    f = reader.fields

    def text(key):
        return bytes(f[key].parts[f[key].data[0]]).decode()

    def strings(key):
        return [bytes(f[key].parts[i]).decode() for i in f[key].data]

    def number(key):
        return f[key].parts[f[key].data[0]][0]

    assert text("general.architecture") == "llama"
    assert (text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")) == ("gpt2", "qwen35")
    assert text("tokenizer.chat_template") == "{{ messages }}"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    tokens = strings("tokenizer.ggml.tokens")
    assert len(tokens) == 2048 and all(tokens[i] == t for t, i in vocab.items())
    assert strings("tokenizer.ggml.merges") == [" ".join(m) for m in tok["model"]["merges"]]
    types = [
        f["tokenizer.ggml.token_type"].parts[i][0] for i in f["tokenizer.ggml.token_type"].data
    ]
    assert types[0] == 3 and types[300] == 1  # <|bos|> is a control token; merges are normal
    assert number("tokenizer.ggml.bos_token_id") == vocab["<|bos|>"]
    assert number("tokenizer.ggml.eos_token_id") == vocab["<|eos|>"]
    assert bool(number("tokenizer.ggml.add_bos_token")) is True
    assert number("llama.block_count") == 2 and number("llama.attention.head_count_kv") == 2
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: the embedding is the head
    want = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}[quant]
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == want
    assert tensors["blk.1.attn_norm.weight"].tensor_type.name == "F32"
    # q rows go from Hugging Face's two halves per head to llama.cpp's adjacent pairs.
    hf_q = _hf_weight(ckpt, "model.layers.0.self_attn.q_proj.weight")
    t = tensors["blk.0.attn_q.weight"]
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(hf_q.shape)
    pairs = hf_q.reshape(4, 2, 8, 64).swapaxes(1, 2).reshape(64, 64)
    tol = {"f32": 0, "f16": 1e-3, "q8_0": 2e-2, "q4_0": 0.2}[quant]
    assert np.abs(got - pairs).max() <= tol * np.abs(pairs).max()
    assert np.abs(got - hf_q).max() > 0.1 * np.abs(hf_q).max()  # not left as it was
    _assert_manifest(out, tmp_path, quant, {t.name: t.tensor_type.name for t in reader.tensors})


def _assert_manifest(out, tmp_path, quant, types):
    """The folder's manifest reads back as a GGUF manifest naming its file, format and tensors'
    types, and records the checkpoint by name and hashes, never by where it lay."""
    import os

    from doel.contracts.manifest import VERSION, read_manifest

    m = read_manifest(out)
    assert (m.kind, m.quant, m.gguf, m.version) == ("gguf", quant, f"model-{quant}.gguf", VERSION)
    assert m.extra["tensors"] == types
    text = (out / "manifest.json").read_text(encoding="utf-8")
    data = json.loads(text)
    assert str(tmp_path) not in text and str(tmp_path.resolve()) not in text
    assert not [s for s in _strings(data) if os.path.isabs(s)]
    assert data["source"]["folder"] == data["checkpoint"] == "ckpt"
    assert data["source"]["weights"]["model.safetensors"]["bytes"] > 0


def _strings(obj) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in [k, *_strings(v)]]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def test_the_table_says_what_llama_cpp_calls_each_gguf_format():
    """Each GGUF row's file type, block and bytes a weight are gguf-py's own for its type."""
    from doel.contracts.quant import QUANTS, names

    for name in names("gguf"):
        row = QUANTS[name]
        ggml = gguf.GGMLQuantizationType[row.gguf_type.upper()]
        assert gguf.LlamaFileType(row.gguf_ftype).name.endswith(row.gguf_type.upper()), name
        block, size = gguf.GGML_QUANT_SIZES[ggml]
        assert row.bytes_per_param == size / block, name
        assert row.block_size == (block if row.quantized else None), name


def test_a_gguf_format_added_to_the_table_is_written_without_other_changes(
    tmp_path, gguf_tokenizer, tiny_model_config, monkeypatch
):
    """A q5_0 row in the table alone: the command line offers it, the writer stores the body at
    Q5_0 and the embedding at the head's q8_0, with llama.cpp's file type for it."""
    from doel.contracts.quant import QUANTS, Quant
    from doel.export.cli import build_parser, main

    row = Quant("q5_0", "gguf", 5, 32, 8, None, 22 / 32, "q5_0", 8)
    monkeypatch.setitem(QUANTS, row.name, row)
    assert "q5_0" in build_parser().format_help()
    ckpt, _ = _checkpoint(tmp_path / "ckpt", gguf_tokenizer[0], tiny_model_config)
    main([str(ckpt), "--out", str(tmp_path / "g"), "--format", "gguf", "--quant", "q5_0"])
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model-q5_0.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == "Q5_0" and types["token_embd.weight"] == "Q8_0"
    field = reader.fields["general.file_type"]
    assert field.parts[field.data[0]][0] == gguf.LlamaFileType.MOSTLY_Q5_0
    _assert_manifest(tmp_path / "g", tmp_path, "q5_0", types)


def _hf_weight(ckpt, key):
    from safetensors.numpy import load_file

    return load_file(str(ckpt / "model.safetensors"))[key].astype(np.float32)


def test_llama_cpp_tokenizes_id_for_id_and_its_f32_logits_equal_pytorchs(
    tmp_path, gguf_tokenizer, tiny_model_config
):
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama-cpp-python is a benchmark-only dependency, built from source in 6-9 min "
        "(benchmarks/serve/bench_serve_llama.py install_llama_cpp); CI does not build it",
    )
    from doel.export.gguf import export_gguf

    path = gguf_tokenizer[0]
    ckpt, model = _checkpoint(tmp_path / "ckpt", path, tiny_model_config)
    export_gguf(ckpt, tmp_path / "g", "f32", log=lambda _m: None)
    llm = llama_cpp.Llama(  # type_k/type_v 0: an f32 KV cache (llama.cpp's default is f16)
        str(tmp_path / "g" / "model-f32.gguf"),
        n_ctx=96,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
    )
    tok = load_tokenizer(path)
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        assert ids == tok.encode(text).ids, text
        assert llm.detokenize(ids[1:]).decode() == text
    ids = tok.encode(TEXTS[0] + " " + TEXTS[3]).ids
    llm.reset()
    llm.eval(ids)
    ours = np.array(llm.scores[: len(ids)], dtype=np.float64)
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].double().numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_doel_train_tokenizer_style_gguf_gives_a_tokenizer_the_gguf_export_accepts(
    tmp_path, sample_paths
):
    from doel.export.gguf import llama_cpp_pre_type
    from doel.train.cli import main

    main(["tokenizer", "--data", *sample_paths, "--vocab-size", "1024", "--style", "gguf"]
         + ["--out", str(tmp_path), "--set", "min_frequency=1", "--quiet"])  # fmt: skip
    path = tmp_path / "tokenizer.json"
    assert llama_cpp_pre_type(json.loads(path.read_text(encoding="utf-8")), path) == "qwen35"
    assert load_tokenizer(path).get_vocab_size() == 1024
