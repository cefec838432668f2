"""Serve over HTTP (FastAPI TestClient, lifespan included): health while loading, models,
completions plain and streamed against the engine's own tokens, tokenize round trips, and every
refusal a 4xx with a message that names the problem."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.contracts.errors import error_body, error_dict
from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.sampling import SamplingParams
from doel.serve.edge.app import Settings, create_app, default_loader


@pytest.fixture(scope="module")
def client(tiny_bundle):
    with TestClient(create_app(Settings(bundle=str(tiny_bundle), threads=1))) as c:
        yield ready(c)


def test_health_is_503_while_loading_then_200(tiny_bundle):
    go = threading.Event()

    def slow(settings):
        go.wait(10)
        return default_loader(settings)

    with TestClient(create_app(Settings(bundle=str(tiny_bundle)), loader=slow)) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        go.set()
        health = ready(c).get("/health").json()
        assert health == {"status": "ok", "models": {tiny_bundle.name: "loaded"}}


def test_a_bundle_that_fails_to_load_is_reported_on_health(tmp_path):
    with TestClient(create_app(Settings(bundle=str(tmp_path)))) as c:
        time.sleep(0.2)
        r = c.get("/health")
        assert r.status_code == 503 and "has no manifest.json" in r.json()["error"]["message"]


def test_the_routes_the_middleware_and_the_connection_limits_answer_one_error_shape(tmp_path):
    from doel.serve.edge.refusal import raw_error

    key = {"Authorization": "Bearer k"}
    with TestClient(create_app(Settings(bundle=str(tmp_path), api_key="k"))) as c:
        refused = c.get("/v1/models")  # by the Guard middleware, before any route
        why = refused.json()["error"]["message"]
        assert refused.content == error_body(401, why, "authentication_error")
        missing = c.get("/nowhere", headers=key)  # by the app's handler
        assert missing.json() == error_dict(404, "Not Found", "invalid_request_error")
    assert raw_error(408, "slow", "invalid_request_error").endswith(
        error_body(408, "slow", "invalid_request_error")
    )


def test_a_route_added_to_the_app_is_counted_under_its_own_name(tmp_path):
    """/metrics reads the route names from the app's router: an endpoint added there (here
    after create_app, as a new one would be in add_routes) is counted under its path, or its
    template with parameters, with no change to serve/edge/metrics.py; a path no route names is
    "other"."""
    app = create_app(Settings(bundle=str(tmp_path)))

    @app.get("/v1/added")
    async def added():
        return {"ok": True}

    @app.get("/v1/things/{name}")
    async def thing(name: str):
        return {"name": name}

    with TestClient(app) as c:
        assert c.get("/v1/added").status_code == 200
        for name in ("a", "b"):
            assert c.get(f"/v1/things/{name}").json() == {"name": name}
        assert c.post("/v1/added").status_code == 405  # that route's, with the wrong method
        assert c.get("/v1/scanned").status_code == 404
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 503  # still loading
        counted = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in c.get("/metrics").text.splitlines()
            if line.startswith("doel_requests_total{")
        }
    row = 'doel_requests_total{{route="{}",status="{}"}}'
    assert counted[row.format("/v1/added", 200)] == 1
    assert counted[row.format("/v1/things/{name}", 200)] == 2
    assert counted[row.format("/v1/added", 405)] == 1
    assert counted[row.format("other", 404)] == 1
    assert counted[row.format("/tokenize", 503)] == 1
    assert not any("/v1/things/a" in k or "/v1/scanned" in k for k in counted)


def test_models_names_the_bundle(client, tiny_bundle):
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in data] == [(tiny_bundle.name, 96)]


def _engine_text(bundle, tok, prompt: str, n: int) -> str:
    e = Engine(read_bundle(bundle), threads=1)
    ids = list(e.generate(tok.encode(prompt).ids, SamplingParams(max_tokens=n, temperature=0)))
    return tok.decode(ids)


def test_greedy_completion_is_the_engines_text_with_usage(client, tiny_bundle, tok):
    prompt = "নদীর ধারে"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == tiny_bundle.name
    assert body["choices"][0]["text"] == _engine_text(tiny_bundle, tok, prompt, 12)
    assert body["choices"][0]["finish_reason"] == "length"
    n = len(tok.encode(prompt).ids)
    assert body["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 12,
        "total_tokens": n + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _events(r) -> list:
    lines = [x for x in r.text.split("\n\n") if x]
    assert all(x.startswith("data: ") for x in lines)
    return [x[len("data: ") :] for x in lines]


def test_streaming_gives_the_same_text_as_one_response_and_ends_in_done(client):
    req = {"prompt": "আমাদের গ্রাম", "max_tokens": 30, "seed": 11, "temperature": 0.9}
    whole = client.post("/v1/completions", json=req).json()
    r = client.post("/v1/completions", json={**req, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"] == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1 and len(chunks) > 3


def test_include_usage_adds_a_usage_chunk_without_choices(client):
    req = {
        "prompt": "a",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = [json.loads(e) for e in _events(client.post("/v1/completions", json=req))[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_seed_reproduces_and_a_stop_string_ends_the_text(client):
    req = {"prompt": "The river", "max_tokens": 40, "seed": 5, "temperature": 1.0}
    a, b = (client.post("/v1/completions", json=req).json() for _ in range(2))
    text = a["choices"][0]["text"]
    assert text == b["choices"][0]["text"] and len(text) > 10
    stop = text[5:8]
    cut = client.post("/v1/completions", json={**req, "stop": [stop]}).json()["choices"][0]
    assert cut == {**cut, "text": text[: text.index(stop)], "finish_reason": "stop"}


def test_token_id_prompts_and_tokenize_round_trip(client, tok):
    text = "চাঁদ উঠল, the moon rose 🙂"
    r = client.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == tok.encode(text).ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 96
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    by_ids = {"prompt": r["tokens"], "max_tokens": 4, "temperature": 0}
    by_text = {"prompt": text, "max_tokens": 4, "temperature": 0}
    a, b = (client.post("/v1/completions", json=x).json() for x in (by_ids, by_text))
    assert a["choices"] == b["choices"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        ("{not json", 400, "JSON decode error"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens: Input should be a valid integer"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens: Input should be greater than"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens is 0 without echo"),
        ({"prompt": "x", "temperature": 2.5}, 400, "temperature: Input should be less than"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0"),
        ({"prompt": "x", "n": 2}, 400, "n: Input should be less than or equal to 1"),
        ({"prompt": "x", "tempreature": 0}, 400, "tempreature: Extra inputs are not permitted"),
        ({"max_tokens": 3}, 400, "prompt: Field required"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
        ({"prompt": [5, 99999]}, 400, "token id 99999 is outside the vocabulary (0 to 2047)"),
        ({"prompt": []}, 400, "the prompt has no tokens"),
        (
            {"prompt": "নদী " * 60, "max_tokens": 40},
            400,
            "tokens and max_tokens is 40: ",
        ),
    ],
)
def test_bad_requests_are_4xx_with_a_message(client, body, status, message):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = client.post("/v1/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


NOT_JSON = "JSON decode error at line"


@pytest.mark.parametrize(
    "body, message",
    [
        (
            b'{"prompt": "x", "max_tokens": 5',
            " 1, column 32: Expecting ',' delimiter; the body ends",
        ),
        (
            b'{"prompt": "x", "max_tokens": 5,}',
            " 1, column 33: Expecting property name enclosed in",
        ),
        (b'{"prompt": "a\\q"}', " 1, column 14: Invalid \\escape"),
        (b'{\n  "prompt": "x",\n  "n": 1\n  "seed": 2\n}', " 4, column 3: Expecting ',' delimiter"),
        (b'{"prompt": "x"} {}', " 1, column 17: Extra data"),
        (b'{"prompt": "\xff"}', " 1, column 13: the body is not UTF-8 (byte 0xff: invalid start"),
        # After a Bangla word (3 characters, 9 bytes) and a space, a 3-byte character cut short
        (
            '{"prompt": "নদী '.encode() + b"\xe0\xa6",
            " 1, column 17: the body is not UTF-8 (byte 0xe0",
        ),
    ],
)
def test_a_body_that_is_not_json_is_400_saying_what_and_where(tmp_path, body, message):
    """It was {"message": "17: JSON decode error", "param": "17"}. No model is needed: the body
    is read before the route asks for one."""
    with TestClient(create_app(Settings(bundle=str(tmp_path)))) as c:
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = c.post(route, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json() == error_dict(
                400, r.json()["error"]["message"], "invalid_request_error"
            )
            assert r.json()["error"]["message"].startswith(NOT_JSON + message), r.text


def test_a_body_nested_past_the_parser_is_400_saying_so(tmp_path):
    with TestClient(create_app(Settings(bundle=str(tmp_path)))) as c:
        r = c.post(
            "/tokenize", content=b"[" * 100_000, headers={"content-type": "application/json"}
        )
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"] == (
        "JSON decode error: the body nests arrays or objects deeper than the parser goes"
    )


def test_a_refusal_lists_five_problems_and_counts_the_rest(client):
    # null in a prompt is wrong for each of its 4 forms: text, ids, texts, id lists
    r = client.post("/v1/completions", json={"prompt": [None] * 5})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert msg.count("; ") == 5 and msg.endswith("; and 11 more problems"), msg


@pytest.mark.parametrize(
    "route, body, param, message",
    [
        ("/v1/completions", {"prompt": [1] * 95, "max_tokens": 1}, None, None),
        ("/v1/completions", {"prompt": [1] * 97}, "prompt", "97 token ids, more than the model's"),
        ("/detokenize", {"tokens": ["x"] * 500}, "tokens", "500 token ids, more than the model's"),
        (
            "/tokenize",
            {"prompt": "x", **{f"j{i}": 0 for i in range(9)}},
            None,
            "body: 9 unknown fields ('j0', 'j1', 'j2', 'j3', 'j4', ...); remove them",
        ),
    ],
)
def test_token_id_lists_are_bounded_by_the_context_and_unknown_fields_counted(
    client, route, body, param, message
):
    """One error for a long list or many unknown fields, found before looking at each."""
    r = client.post(route, json=body)
    if message is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert message in r.json()["error"]["message"] and r.text.count("; ") == 1


def test_a_text_prompt_that_cannot_fit_is_refused_before_it_is_encoded(client, tiny_bundle):
    svc = client.app.state.service
    encoded = []
    encode = svc.encode
    svc.encode = lambda *a: encoded.append(a) or encode(*a)
    try:
        r = client.post("/v1/completions", json={"prompt": "নদী " * 2000, "max_tokens": 1})
    finally:
        svc.encode = encode
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and not encoded
    assert "the prompt (8,000 characters) is at least" in msg and "context is 96 tokens" in msg


def test_a_prompt_longer_than_the_context_says_both_numbers(client, tok):
    n = len(tok.encode("নদী " * 200).ids)
    r = client.post("/v1/completions", json={"prompt": "নদী " * 200, "max_tokens": 1})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and f"the prompt is {n} tokens" in msg
    assert "the model's context is 96 tokens" in msg and r.json()["error"]["param"] == "prompt"


def test_a_body_over_the_limit_is_413(tiny_bundle):
    app = create_app(Settings(bundle=str(tiny_bundle), max_body_bytes=100))
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 200})
        assert r.status_code == 413 and "limit of 100 bytes" in r.json()["error"]["message"]
        chunked = c.post("/tokenize", content=iter([b'{"prompt": "', b"y" * 200, b'"}']))
        assert chunked.status_code == 413


def test_the_api_key_guards_everything_but_health(tiny_bundle):
    with TestClient(create_app(Settings(bundle=str(tiny_bundle), api_key="s3cret"))) as c:
        ready(c)
        assert c.get("/v1/models").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert c.post("/tokenize", json={"prompt": "a"}, headers=wrong).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/tokenize", json={"prompt": "a"}, headers=ok).status_code == 200
        assert c.get("/openapi.json").status_code == 401
        assert c.get("/").status_code == 200  # the page; its requests carry the key


def _metric(client: TestClient, line_start: str) -> float:
    text = client.get("/metrics").text
    found = [x for x in text.splitlines() if x.startswith(line_start + " ")]
    return float(found[0].split()[-1]) if found else 0.0


def test_metrics_count_requests_tokens_and_first_token_times(client):
    ok = 'doel_requests_total{route="/v1/completions",status="200"}'
    bad = 'doel_requests_total{route="/v1/completions",status="400"}'
    before = [_metric(client, k) for k in (ok, bad, "doel_generation_tokens_total")]
    ttft = _metric(client, "doel_time_to_first_token_seconds_count")
    client.post("/v1/completions", json={"prompt": "নদী", "max_tokens": 7, "temperature": 0})
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    after = [_metric(client, k) for k in (ok, bad, "doel_generation_tokens_total")]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 7]
    assert _metric(client, "doel_time_to_first_token_seconds_count") == ttft + 1
    assert _metric(client, "doel_decode_tokens_per_second") > 0
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE doel_queue_depth gauge" in r.text and "doel_queue_depth 0" in r.text
    assert 'le="+Inf"' in r.text


def test_metrics_count_the_draft_ids_verified_and_kept(client):
    names = ("doel_draft_tokens_total", "doel_draft_tokens_accepted_total")
    before = [_metric(client, k) for k in names]
    # A prompt that repeats itself: its last ids occurred before, so the first step drafts.
    body = {"prompt": "নদী বয়ে যায় " * 8, "max_tokens": 12, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200
    drafted, kept = (_metric(client, k) - b for k, b in zip(names, before))
    assert drafted > 0 and 0 <= kept <= drafted
    text = client.get("/metrics").text
    assert "# TYPE doel_draft_tokens_total counter" in text


def test_the_playground_page_streams_from_the_completions_route(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert '<html lang="bn">' in page and 'id="prompt"' in page
    for control in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop"):
        assert f'id="{control}"' in page
    assert '"/v1/completions"' in page and "stream: true" in page and "getReader" in page


def test_the_playground_opens_in_chat_mode_for_a_bundle_with_a_chat_template(tmp_path, client):
    """It opened in completion mode on the demo's chat model. The mode is the server's to say,
    from the bundle's files: right while the model loads, and without the API key."""
    assert '<body data-mode="chat">' in client.get("/").text  # the tiny bundle has a template
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with TestClient(create_app(Settings(bundle=str(tmp_path), api_key="k"))) as c:
        assert '<body data-mode="completion">' in c.get("/").text
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with TestClient(create_app(Settings(bundle=str(tmp_path), api_key="k"))) as c:
        page = c.get("/")
    assert page.status_code == 200 and '<body data-mode="chat">' in page.text
    assert 'dataset.mode === "chat"' in page.text and '$("mode-chat").checked = true' in page.text


def test_the_playground_serves_its_own_bengali_font(tmp_path):
    """Bangla was drawn as boxes on a machine without a Bengali font. The page names Noto Sans
    Bengali (OFL, its license beside it) as a web font from this server, not a CDN, for the
    Bengali block; it is answered without the API key, as the page is."""
    from doel.serve.playground import FONT_FILE, FONT_PATH

    with TestClient(create_app(Settings(bundle=str(tmp_path), api_key="k"))) as c:
        page, font = c.get("/").text, c.get(FONT_PATH)
        assert c.get("/v1/models").status_code == 401  # the key still guards the API
    assert font.status_code == 200 and font.headers["content-type"] == "font/woff2"
    assert font.content[:4] == b"wOF2" and font.content == FONT_FILE.read_bytes()
    assert 20_000 < len(font.content) < 100_000  # the Bengali subset, one weight
    assert "SIL OPEN FONT LICENSE Version 1.1" in (FONT_FILE.parent / "OFL.txt").read_text("utf-8")
    face = page.split("@font-face", 1)[1].split("}", 1)[0]
    assert f'src: url("{FONT_PATH}") format("woff2")' in face and "U+0980-09FE" in face
    assert '"doel Bengali", system-ui' in page  # after the installed ones, before any fallback
    assert "http" not in page  # nothing from elsewhere


def test_a_stop_string_over_256_characters_is_refused_by_name(client):
    r = client.post("/v1/completions", json={"prompt": "x", "stop": ["a", "b" * 257]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stop", r.text
    assert "257 characters, over the limit of 256" in err["message"]
    for stop in ("b" * 256, "hello", ["a", "b" * 256]):  # a string stop is not a list of 4
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stop": stop})
        assert r.status_code == 200, r.text


def test_an_unexpected_error_is_an_openai_shaped_500_and_counted(tiny_bundle):
    def broken(*_a):
        raise ZeroDivisionError("a bug")

    app = create_app(Settings(bundle=str(tiny_bundle), threads=1))
    with TestClient(app, raise_server_exceptions=False) as c:
        ready(c).app.state.service.encode = broken
        r = c.post("/tokenize", json={"prompt": "নদী"})
        assert r.status_code == 500, r.text
        assert r.json()["error"] == {
            "message": "internal error (ZeroDivisionError); the server's log has the details",
            "type": "server_error",
            "param": None,
            "code": 500,
        }
        assert _metric(c, 'doel_requests_total{route="/tokenize",status="500"}') == 1


def test_each_route_module_is_a_route():
    from doel.serve.edge.answer import Route
    from doel.serve.endpoints.chat import route as chat
    from doel.serve.endpoints.completions import route as completions
    from doel.serve.endpoints.responses import route as responses

    assert all(isinstance(m, Route) for m in (completions, chat, responses))
