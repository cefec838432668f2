"""A live `doel-serve` on loopback under the abuse of issue 15, bounded in count and time: stop
strings at their cap over long completions, refusals kept short, clients that leave, text that is
not Unicode. The model is the tiny random one with 4,096 positions, so that one greedy request
can run for seconds (about 2,000 tokens a second here)."""

from __future__ import annotations

import re

import httpx2
import pytest
from live_server import live_server

pytestmark = pytest.mark.slow

CONTEXT = 4096
PROMPT = "নদীর ধারে একটি ছোট গ্রাম"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tokenizer_path):
    pytest.importorskip("onnxruntime_genai")
    torch = pytest.importorskip("torch")
    from export.bundle import ExportOptions, export_checkpoint
    from train.hf import save_model
    from train.model import Llama, ModelConfig

    cfg = ModelConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
    )
    root = tmp_path_factory.mktemp("abuse")
    torch.manual_seed(0)
    ckpt = save_model(Llama(cfg), root / "ckpt", tokenizer=tokenizer_path)
    out = root / "long"
    export_checkpoint(ckpt, out, ExportOptions(quant="fp32", eval_tokens=64, log=lambda _m: None))
    return out


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    args = ("--slots", "2", "--max-queue", "2")
    with live_server(bundle, tmp_path_factory.mktemp("log"), *args) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url, trust_env=False, timeout=60) as c:
        yield c


def metric(http: httpx2.Client, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_stop_strings_at_the_cap_over_2000_tokens_and_one_over_it(http):
    """Four 256-character stops that never match leave a 2,000-token completion as it is;
    one of 257 characters is refused by name before any work."""
    req = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0}
    plain = http.post("/v1/completions", json=req).json()
    assert plain["usage"]["completion_tokens"] == 2000
    text = plain["choices"][0]["text"]
    stops = [text[k : k + 255] + "\x00" for k in (0, 100, 500, 1000)]
    stopped = http.post("/v1/completions", json={**req, "stop": stops}).json()
    assert stopped["choices"] == plain["choices"]
    r = http.post("/v1/completions", json={**req, "stop": [*stops[:3], "x" * 257]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stop"
    assert err["message"] == (
        "stop: a stop string is 257 characters, over the limit of 256; shorten it"
    )
