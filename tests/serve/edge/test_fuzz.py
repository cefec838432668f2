"""Serve: whatever JSON a client sends to the POST routes (right fields with wrong types, values
out of range, unknown fields, streams), the answer is 2xx or 4xx with an error message, never a
5xx."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ready import ready

from doel.serve.edge.app import Settings, create_app

FIELDS = [
    "prompt", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "stop", "stream", "stream_options", "n",
    "model", "echo", "logprobs", "tokens", "add_special_tokens", "junk",
]  # fmt: skip
# Text with lone surrogates too: JSON's "\ud800" escape without its pair parses into one (the
# bodies are sent as json.dumps writes them, escapes and all). st.text leaves surrogates out of
# any alphabet, so characters are joined here.
CHARS = st.one_of(st.characters(), st.characters(categories=["Cs"]))
TEXT = st.lists(CHARS, max_size=20).map("".join)
SURROGATES = st.sampled_from(["a\ud800b", "\udfff", "নদী\udc00"])
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.integers(0, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 2),
    TEXT,
    st.sampled_from(["নদীর ধারে", "গ্", "\ud7ff🙂", "<|eos|>", ""]),
    SURROGATES,
    st.lists(st.integers(-3, 2100), max_size=6),
    st.lists(TEXT, max_size=6),
    st.dictionaries(st.sampled_from(["include_usage", "x"]), st.booleans(), max_size=2),
)
# Bodies within the bounds too (edges included), so that many requests really generate.
NEAR = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(0, 60),
        "temperature": st.floats(0, 2),  # 5e-324 included: greedy, not inf
        "top_p": st.floats(0, 1),
        "top_k": st.integers(-1, 3000),
        "repetition_penalty": st.floats(0.01, 3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=4)),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "echo": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    },
)
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8)
IDS = st.lists(st.integers(0, 2047), min_size=1, max_size=8)
PROMPTS = st.one_of(
    st.text(max_size=30),
    IDS,
    # a batch, one choice each; 8 characters are at most 33 tokens, which leave 60 to generate
    st.lists(st.text(max_size=8), min_size=1, max_size=3),
    st.lists(IDS, min_size=1, max_size=3),
)


@pytest.fixture(scope="module")
def client(tiny_bundle):
    with TestClient(create_app(Settings(bundle=str(tiny_bundle), threads=1))) as c:
        ready(c)
        yield c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    route=st.sampled_from(["/v1/completions", "/tokenize", "/detokenize"]),
    body=BODIES,
    prompt=st.one_of(st.none(), TEXT, SURROGATES, st.lists(st.integers(0, 2047), max_size=8)),
)
def test_no_request_body_gives_a_5xx(client, route, body, prompt):
    if prompt is not None:
        body = {**body, "prompt": prompt}
    r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    elif body.get("stream") is True and route == "/v1/completions":
        assert r.text.endswith("data: [DONE]\n\n")


def _past_the_context(client, prompt, max_tokens: int) -> bool:
    """The longest prompt of the request and max_tokens more do not fit the context (a text of
    30 characters outside the tiny tokenizer's alphabet is up to 120 byte tokens): the server's
    answer is then a 400 that says so."""
    batch = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    counts, ctx = [], 0
    for p in batch:
        r = client.post("/tokenize", json={"prompt": p if isinstance(p, str) else ""}).json()
        counts.append(len(p) if isinstance(p, list) else r["count"])
        ctx = r["max_model_len"]
    return max(counts) + max_tokens > ctx


@settings(max_examples=60, deadline=None)
@given(body=NEAR, prompt=PROMPTS)
@example(body={"max_tokens": 57}, prompt="日本語の文" * 6)  # ~90 byte tokens: past the context
def test_completions_within_the_bounds_succeed(client, body, prompt):
    n = len(prompt) if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else 1
    scoring = body.get("echo") or body.get("logprobs") is not None or n > 1
    edge = (
        (body.get("max_tokens") == 0 and not body.get("echo"))
        or body.get("top_p") == 0
        or (body.get("stream") and scoring)
        or _past_the_context(client, prompt, body.get("max_tokens", 16))
    )
    body = {**body, "prompt": prompt}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == (400 if edge else 200), r.text
    if edge:
        return
    if body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n")
        return
    out, most = r.json(), body.get("max_tokens", 16)
    assert [c["index"] for c in out["choices"]] == list(range(n))
    assert out["usage"]["completion_tokens"] <= n * most  # 0 too: <|eos|> may come first
    for c in out["choices"]:
        if body.get("logprobs") is None:
            assert c["logprobs"] is None
            continue
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert all(x is None or x <= 0 for x in lp["token_logprobs"])


PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": TEXT}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), VALUES, max_size=3),
    VALUES,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
            "content": st.one_of(TEXT, SURROGATES, st.lists(PART, max_size=3), VALUES),
        },
        optional={"name": VALUES, "junk": VALUES},
    ),
    VALUES,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.dictionaries(st.sampled_from([*FIELDS, "max_completion_tokens"]), VALUES, max_size=6),
    messages=st.one_of(st.lists(MESSAGE, max_size=4), VALUES),
)
def test_no_chat_body_gives_a_5xx(client, body, messages):
    body = {"max_tokens": 4, **body, "messages": messages}  # replies kept short
    r = client.post(
        "/v1/chat/completions",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    elif body.get("stream") is True:
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.json()["object"] == "chat.completion"
