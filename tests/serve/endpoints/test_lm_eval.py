"""lm-eval scores a served bundle: its `local-completions` model (token ids in batches, `echo`,
`logprobs`, `max_tokens: 1`, as lm-eval 0.4.13 sends them) against a live doel-serve gives the
same log-likelihood for every choice of a small multiple-choice task as `doel-train eval`'s
scorer (train/evals/scoring.py) on the checkpoint the bundle was exported from.

The bundle is fp32: an int8/int4 bundle differs from the torch checkpoint by its quantization
(its loss increase is what doel-export reports), far more than the 1e-3 this compares to."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from live_server import live_server

CONTEXT = 96  # the model's positions; lm-eval keeps one for the token it asks for
WORDS = "আমার সোনার বাংলা আমি তোমায় ভালোবাসি the quick brown fox jumps over a lazy dog".split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_piqa(folder, n: int, seed: int = 0):
    """PIQA's layout (valid.jsonl + valid-labels.lst), which both doel and lm-eval read."""
    rng = random.Random(seed)
    folder.mkdir()
    rows = [
        {"goal": _sentence(rng, 4) + "?", "sol1": _sentence(rng, 5), "sol2": _sentence(rng, 3)}
        for _ in range(n)
    ]
    (folder / "valid.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    (folder / "valid-labels.lst").write_text("".join(f"{rng.randrange(2)}\n" for _ in rows))
    return folder


@pytest.fixture(scope="module")
def checkpoint_and_bundle(tmp_path_factory, tokenizer_path, tiny_model_config):
    """A checkpoint with spread weights (at the 0.02 init every distribution is near uniform,
    which would hide a token scored at the wrong place) and its fp32 bundle."""
    pytest.importorskip("onnxruntime_genai")
    torch = pytest.importorskip("torch")
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.hf import save_model
    from doel.train.model import Llama

    torch.manual_seed(0)
    model = Llama(tiny_model_config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 2.0 / math.sqrt(p.shape[1]))
    out = tmp_path_factory.mktemp("lm-eval")
    ckpt = save_model(model, out / "ckpt", tokenizer=tokenizer_path)
    bundle = out / "bundle"
    export_checkpoint(
        ckpt, bundle, ExportOptions(quant="fp32", eval_tokens=64, log=lambda _m: None)
    )
    return ckpt, bundle


@pytest.mark.slow
def test_lm_eval_against_doel_serve_equals_doel_train_eval(
    checkpoint_and_bundle, tmp_path, monkeypatch
):
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (its `api` extra)
    from doel.train.data.tokenizer import load_tokenizer
    from doel.train.evals import scoring, tasks
    from doel.train.evals.crosscheck import lm_eval_choices
    from doel.train.hf import load_model

    ckpt, bundle = checkpoint_and_bundle
    assert read_context(bundle) == CONTEXT
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the tokenizer is a local folder
    piqa = write_piqa(tmp_path / "piqa", 12)
    items = tasks.load_task("piqa", piqa)
    ours = scoring.score_items(load_model(ckpt), load_tokenizer(ckpt), items, batch_size=5)
    with live_server(bundle, tmp_path) as server:
        model_args = {
            "base_url": f"{server.url}/v1/completions",
            "model": bundle.name,
            # transformers' AutoTokenizer over the bundle's own tokenizer files
            "tokenizer": str(bundle),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,  # token ids go over the wire, not text
            "add_bos_token": True,  # doel's scorer (and training) puts <|bos|> first
            "max_length": CONTEXT,
            "batch_size": 5,  # several prompts per request: one choice each
            "max_retries": 1,
        }
        theirs = lm_eval_choices(
            None, "piqa", piqa, model="local-completions", model_args=model_args
        )
        log = server.log_text()
    assert len(theirs) == len(items) == 12 and "Traceback" not in log
    for it, ll, th in zip(items, ours, theirs):
        np.testing.assert_allclose(th["lls"], ll, rtol=0, atol=1e-3)
        assert bool(th["acc"]) == (int(np.argmax(ll)) == it.gold)
    spread = max(abs(a - b) for ll in ours for a, b in zip(ll, ll[1:]))
    assert spread > 1.0  # the choices' scores differ by far more than the tolerance


def read_context(bundle) -> int:
    return json.loads((bundle / "manifest.json").read_text())["context_length"]
