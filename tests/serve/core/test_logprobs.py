"""Scoring on /v1/completions: batched prompts (text or ids, one choice each), `echo`, `logprobs`
(OpenAI's legacy shape) and `max_tokens: 0`, checked against the engine's own logits and a
brute-force softmax; the bounds and OpenAI-shaped refusals of the new fields."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.logprobs import logsumexp, score_rows
from doel.serve.edge.app import Settings, create_app
from doel.serve.endpoints.protocol import MAX_PROMPTS, CompletionRequest

BN = "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।"
EN = "The quick brown fox jumps over the lazy dog."


def log_softmax(logits) -> np.ndarray:
    """The reference: float64 throughout."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_logsumexp_is_float64s_where_float32_alone_is_not():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 32768)) * 3 + 40).astype(np.float32)
    exact = np.log(np.exp(logits.astype(np.float64) - 50).sum(-1)) + 50
    np.testing.assert_allclose(logsumexp(logits), exact, rtol=0, atol=1e-6)
    m = logits.max(-1)  # all in float32: what the float64 sum is there to avoid
    naive = m + np.log(np.exp(logits - m[:, None]).sum(-1, dtype=np.float32))
    assert np.abs(naive - exact).max() > 1e-6
    assert np.isfinite(logsumexp(np.array([1e4, -1e4, 0.0], np.float32))).all()


def test_score_rows_picks_the_target_and_the_top_ids_in_order():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, -2.0], [5.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    rows = score_rows(logits, [2, 0], top=3)
    lp = log_softmax(logits)
    np.testing.assert_allclose([r.logprob for r in rows], [lp[0, 2], lp[1, 0]], atol=1e-12)
    assert rows[0].top_ids == (1, 3, 2)  # most likely first; equal ones by id
    assert rows[1].top_ids[0] == 0 and len(set(rows[1].top_ids)) == 3
    np.testing.assert_allclose(rows[0].top_logprobs, lp[0, [1, 3, 2]], atol=1e-12)
    assert score_rows(logits, [4], top=0)[0].top_ids == ()
    rng = np.random.default_rng(1)
    big = (rng.standard_normal((6, 4000)) * 5).astype(np.float32)
    targets = rng.integers(0, 4000, 6).tolist()
    scored = score_rows(big, targets, top=5)
    lp = log_softmax(big)
    np.testing.assert_allclose([s.logprob for s in scored], lp[range(6), targets], atol=1e-6)
    for s, row in zip(scored, lp):
        assert list(s.top_ids) == np.argsort(-row, kind="stable")[:5].tolist()


def _refusal(**body) -> str:
    with pytest.raises(ValueError) as e:
        CompletionRequest(**body)
    return str(e.value)


def test_new_fields_are_bounded():
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt="a", echo=True, max_tokens=0, logprobs=5).logprobs == 5
    assert "less than or equal to 5" in _refusal(prompt="a", logprobs=6)
    assert "greater than or equal to 0" in _refusal(prompt="a", logprobs=-1)
    assert "set echo" in _refusal(prompt="a", max_tokens=0)
    assert "stream takes one prompt" in _refusal(prompt=["a", "b"], stream=True)
    assert "stream takes one prompt" in _refusal(prompt="a", stream=True, logprobs=1)
    assert f"at most {MAX_PROMPTS} items" in _refusal(prompt=["a"] * (MAX_PROMPTS + 1))
    assert "valid" in _refusal(prompt=[[1], "a"])  # one kind per batch
    assert "valid" in _refusal(prompt="a", echo=1)  # strict: 1 is not a boolean


@pytest.fixture(scope="module")
def client(tiny_bundle):
    with TestClient(create_app(Settings(bundle=str(tiny_bundle), threads=1, slots=2))) as c:
        ready(c)
        yield c


@pytest.fixture(scope="module")
def engine(tiny_bundle):
    return Engine(read_bundle(tiny_bundle), threads=1)


def _ids(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_every_positions_logits_equal_the_last_ones_of_each_prefix(engine, tiny_bundle, tok):
    ids = tok.encode(BN + " " + EN).ids
    assert len(ids) > 29
    engine.prefill_chunk = 7  # several chunks, each attending to the ones before
    try:
        every = engine.forward(ids, 0, every=True)
        assert every.shape == (len(ids), read_bundle(tiny_bundle).vocab_size)
        for n in (1, 6, 7, 8, 23, len(ids)):
            np.testing.assert_allclose(every[n - 1], engine.forward(ids[:n], 0), atol=1e-4)
        # a last chunk of one token (the one-row output buffer), and a prompt of one token
        for n in (29, 1):
            np.testing.assert_allclose(engine.forward(ids[:n], 0, every=True), every[:n], atol=1e-4)
    finally:
        engine.prefill_chunk = 128


@pytest.mark.slow
def test_every_positions_logits_on_a_growing_cache_graph(tmp_path, tokenizer_path, tok):
    """optimum's graph (a cache grown by concatenation, positions as an input) gives every
    position's logits too."""
    pytest.importorskip("optimum")
    torch = pytest.importorskip("torch")
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64)  # fmt: skip
    ckpt = save_model(Llama(cfg), tmp_path / "ckpt", tokenizer=tokenizer_path)
    opts = ExportOptions(quant="fp32", engine="optimum", eval_tokens=32, log=lambda _m: None)
    export_checkpoint(ckpt, tmp_path / "bundle", opts)
    engine = Engine(read_bundle(tmp_path / "bundle"), threads=1)
    assert not engine.bundle.share_buffer
    ids = tok.encode(EN).ids
    every = engine.forward(ids, 0, every=True)
    assert every.shape[0] == len(ids)
    for n in (1, 5, len(ids)):
        np.testing.assert_allclose(every[n - 1], engine.forward(ids[:n], 0), atol=1e-4)


def _brute(engine, ids: list[int]) -> np.ndarray:
    """log P(ids[i] | ids[:i]) for i >= 1, each from its own forward of the prefix."""
    return np.array([log_softmax(engine.forward(ids[:i], 0))[ids[i]] for i in range(1, len(ids))])


def test_echo_logprobs_score_every_prompt_token_in_a_batch(client, engine):
    ids = _ids(client, EN)
    svc = client.app.state.service
    svc.engine.prefill_chunk = 4  # the scheduler's chunks: each scores its rows
    try:
        body = {"prompt": [BN, EN], "max_tokens": 1, "echo": True, "logprobs": 3}
        r = client.post("/v1/completions", json=body | {"temperature": 0})
    finally:
        svc.engine.prefill_chunk = 128
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    en = out["choices"][1]
    lp = en["logprobs"]
    assert en["text"].startswith(EN) and len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1 : len(ids)], _brute(engine, ids), atol=1e-4)
    for top in lp["top_logprobs"][1:]:
        assert len(top) == 3 and list(top.values()) == sorted(top.values(), reverse=True)
    # greedy: the new token is the most likely one, its logprob the top one
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    assert lp["text_offset"][1] == 0 and lp["text_offset"][-1] == len(EN)
    bn_tokens = len(_ids(client, BN))
    assert out["usage"] == {
        "prompt_tokens": len(ids) + bn_tokens,
        "completion_tokens": 2,
        "total_tokens": len(ids) + bn_tokens + 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_id_prompts_with_max_tokens_0_only_score(client, engine):
    ids = _ids(client, BN)
    body = {"prompt": [ids, ids[:5]], "max_tokens": 0, "echo": True, "logprobs": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    first, second = r.json()["choices"]
    assert r.json()["usage"]["completion_tokens"] == 0
    assert first["text"] == BN and second["finish_reason"] == "length"
    assert len(first["logprobs"]["tokens"]) == len(ids)
    assert first["logprobs"]["top_logprobs"][1:] == [{}] * (len(ids) - 1)
    np.testing.assert_allclose(first["logprobs"]["token_logprobs"][1:], _brute(engine, ids), 1e-4)
    assert second["logprobs"]["token_logprobs"] == first["logprobs"]["token_logprobs"][:5]


def test_logprobs_without_echo_cover_the_completion_only(client):
    body = {"prompt": EN, "max_tokens": 4, "logprobs": 2, "temperature": 0}
    r = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = r["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4 and None not in lp["token_logprobs"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] < len(r["text"])
    plain = client.post("/v1/completions", json=body | {"logprobs": None}).json()
    assert plain["choices"][0]["text"] == r["text"] and plain["choices"][0]["logprobs"] is None


def test_a_bad_prompt_in_a_batch_is_a_400_and_the_server_answers_on(client):
    for body, param in [
        ({"prompt": [[1, 2], [999_999]], "echo": True, "max_tokens": 0}, "prompt"),
        ({"prompt": [[1, 2], []], "max_tokens": 1}, "prompt"),
        ({"prompt": ["a"], "logprobs": 9}, "logprobs"),
        ({"prompt": "a", "max_tokens": 0}, None),
    ]:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    ok = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
