"""A base model's text ends where its document ends, in every runtime: prepare writes each
document as `<|bos|> text <|eos|>` and records it (shard header version 2, meta.json); shards of
version 1 still load; a tiny model trained on such shards ends a greedy completion with "stop"
(the <|eos|> not in the text) in doel-serve, transformers' generate(), optimum, llama-server on
its GGUF and onnxruntime-genai 0.18 on its bundle, and the Modelfile stops there (the same model
trained on version 1 shards runs to the limit); a chat render still holds no <|eos|> (chat
turns end at <|end|>)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.runtimes import end_of_document as eod
from doel.train.data.loader import TokenLoader
from doel.train.data.shards import ShardWriter, open_shard, read_header
from doel.train.data.tokenizer import EOS

SKIP_LLAMA = (
    f"llama-server not built at {eod.BINARY}: python -m benchmarks.load.bench_load "
    "--install-llama-server"
)
SKIP_GENAI = (
    f"onnxruntime-genai 0.18 venv missing at {eod.ORTGENAI_PYTHON}: python -m venv it and "
    "pip install onnxruntime-genai==0.18.0"
)


def test_every_document_in_the_shards_ends_with_eos_and_meta_says_so(shards, tok):
    meta = json.loads((shards / "meta.json").read_text())
    eos = tok.token_to_id(EOS)
    assert meta["tokenizer"]["eos_id"] == eos and meta["format"]["version"] == 2
    assert meta["format"]["document"] == "<|bos|> text <|eos|>"
    for split in ("train", "val"):
        for s in meta["splits"][split]["shards"]:
            h, ids = open_shard(shards / s["file"])
            starts, ends = np.flatnonzero(ids == h.bos_id), np.flatnonzero(ids == eos)
            assert h.eos_id == eos and ids[-1] == eos
            assert list(ends + 1) == [*starts[1:], len(ids)]  # each ends right before the next


def test_a_version_1_shard_folder_still_loads(tmp_path):
    """Shards written before documents ended with <|eos|>: the header says version 1, no eos,
    and the loader trains on them as before."""
    w = ShardWriter(tmp_path, "train", vocab_size=50, bos_id=0, shard_tokens=1000)
    docs = [np.array([0, *range(5, 5 + n)], dtype=np.uint16) for n in (30, 40, 50)]
    w.add(np.concatenate(docs), np.array([len(d) for d in docs]))
    (shard,) = w.close()
    h = read_header(tmp_path / shard["file"])
    assert (h.version, h.eos_id, h.n_docs) == (1, None, 3)
    meta = {"format": {"version": 1}, "tokenizer": {"sha256": "-", "vocab_size": 50, "bos_id": 0}}
    meta["splits"] = {"train": {"shards": [shard]}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    x, y = TokenLoader(tmp_path, batch_size=2, seq_len=16).next_batch()
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()


def test_a_chat_render_holds_no_eos(tok):
    """SFT renders conversations itself (train/data/chat.py), not through prepare: a turn ends at
    <|end|>, and <|eos|> appears nowhere in a conversation."""
    from doel.train.data.chat import render

    messages = [
        {"role": "system", "content": "তুমি সাহায্য করো।"},
        {"role": "user", "content": "ডোয়েল কী?"},
        {"role": "assistant", "content": "একটি পাখি।"},
        {"role": "user", "content": "আর?"},
        {"role": "assistant", "content": "বাংলাদেশের জাতীয় পাখি।"},
    ]
    seq, _ = render(tok, messages)
    assert tok.token_to_id(EOS) not in seq.tolist()
    assert seq[-1] == tok.token_to_id("<|end|>")


# ------------------------------------------------------------------ a model trained to end


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("onnxruntime_genai")  # the export extra
    return eod.build(tmp_path_factory.mktemp("end-of-document"))


def _ends(r: dict, ending: str) -> None:
    assert r["finish"] == "stop" and r["tokens"] < eod.MAX_NEW, r
    assert r["text"].endswith(ending) and "<|" not in r["text"], r


PROMPTS = list(eod.PROMPTS.items())


@pytest.mark.slow
@pytest.mark.parametrize("prompt,ending", PROMPTS, ids=["bn", "en"])
def test_doel_serve_stops_at_the_end_of_the_document(built, prompt, ending):
    _ends(eod.doel_serve(built["bundle"], prompt), ending)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,ending", PROMPTS, ids=["bn", "en"])
def test_transformers_generate_stops_at_the_end_of_the_document(built, prompt, ending):
    pytest.importorskip("transformers")
    _ends(eod.transformers_generate(built["checkpoint"], prompt), ending)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,ending", PROMPTS, ids=["bn", "en"])
def test_optimum_stops_at_the_end_of_the_document(built, prompt, ending):
    pytest.importorskip("optimum.onnxruntime")
    _ends(eod.optimum_generate(built["bundle"], prompt), ending)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,ending", PROMPTS, ids=["bn", "en"])
def test_llama_server_stops_at_the_end_of_the_document(built, prompt, ending, tmp_path):
    if not eod.BINARY.is_file():
        pytest.skip(SKIP_LLAMA)
    _ends(eod.llama_server(built["gguf"], prompt, tmp_path / "llama.log"), ending)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,ending", PROMPTS, ids=["bn", "en"])
def test_onnxruntime_genai_stops_at_the_end_of_the_document(built, prompt, ending):
    if not eod.ORTGENAI_PYTHON.is_file():
        pytest.skip(SKIP_GENAI)
    _ends(eod.genai(built["bundle"], prompt), ending)


@pytest.mark.slow
def test_the_same_model_trained_without_eos_in_its_shards_runs_to_the_limit(built, tmp_path):
    """The control: what the stops above are owed to. Documents separated by <|bos|> alone (a
    version 1 folder), the same training: the completion runs to max_tokens."""
    bundle = eod.build_before(tmp_path, built)
    r = eod.doel_serve(bundle, PROMPTS[0][0])
    assert r["finish"] == "length" and r["tokens"] == eod.MAX_NEW, r


@pytest.mark.slow
def test_every_exported_file_names_eos_as_an_end(built):
    eos = json.loads((built["checkpoint"] / "generation_config.json").read_text())["eos_token_id"]
    genai = json.loads((built["bundle"] / "genai_config.json").read_text())["model"]
    assert eos in np.atleast_1d(genai["eos_token_id"]).tolist()
    assert (
        json.loads((built["bundle"] / "generation_config.json").read_text())["eos_token_id"] == eos
    )
    assert EOS in eod.modelfile_stops(built["gguf_dir"])
    gguf = pytest.importorskip("gguf")
    field = gguf.GGUFReader(built["gguf"]).fields["tokenizer.ggml.eos_token_id"]
    assert int(field.parts[field.data[0]][0]) == eos
