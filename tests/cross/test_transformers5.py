"""transformers' newest 5.x, in a venv of its own (doel's pins 4.57.6 for optimum, whose tests
are tests/cross/test_reach.py), reads a model folder of doel's default tokenizer (spm) as doel
does: AutoTokenizer's ids equal `tokenizers`' on the corner cases and the sample's lines, and
its chat template renders doel-serve's prompt. The probe is benchmarks/runtimes/transformers5.py's,
run in that venv; without the venv the test skips (.ci/outside_tools makes it)."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from corners import CORNERS

from benchmarks.runtimes.genai import CHATS
from benchmarks.runtimes.transformers5 import VENV, run_probe

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[2] / "train" / "sample"


@pytest.fixture(scope="module")
def folder(tmp_path_factory, sample_paths, tiny_model_config):
    """A random tiny model saved with an spm tokenizer trained on the sample (whose
    tokenizer_config.json carries the chat template, as every doel tokenizer's does)."""
    import dataclasses

    import torch

    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama

    out = tmp_path_factory.mktemp("tf5")
    cfg = TokenizerConfig(vocab_size=1024, min_frequency=1, style="spm")
    tok = train_tokenizer(resolve_sources(sample_paths), cfg, out / "tok", progress=False)
    model = dataclasses.replace(tiny_model_config, vocab_size=1024)
    torch.manual_seed(0)
    return save_model(Llama(model), out / "final", tokenizer=tok)


def test_transformers_5_gives_tokenizers_ids_and_doel_serves_chat_prompt(folder, tmp_path):
    if not VENV.exists():
        pytest.skip(f"no transformers 5.x venv at {VENV}: .ci/outside_tools makes it")
    from tokenizers import Tokenizer

    from doel.serve.core.template import ChatTemplate

    lines = [x for p in ("bn.txt", "en.txt") for x in (SAMPLE / p).read_text().splitlines()[:40]]
    texts = CORNERS + [unicodedata.normalize("NFD", t) for t in CORNERS] + lines
    got = run_probe({"bundle": str(folder), "texts": texts, "chat": CHATS}, tmp_path)
    assert got["version"].startswith("5.")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = [e.ids for e in tok.encode_batch(texts)]
    assert [i for i, (a, b) in enumerate(zip(got["ids"], want)) if a != b] == []
    chat = ChatTemplate.load(folder)
    assert got["chat"] == [chat.render(m) for m in CHATS]
