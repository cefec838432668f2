"""What a request may make the server hold and compile (issue 48, point 2): the tools' count, a
tool schema's size, the Responses API's input items and their bytes are each bounded by a
Settings field (its flag), refused in one line naming the flag, with the parameter, in the OpenAI
error shape, before any work; one under each bound passes. llguidance's parser limits are this
server's (`grammar_limits.PARSER_LIMITS`), and a grammar past one is a 400 naming the limit. A
compile runs off the event loop and past --compile-timeout is a 400 while the loop keeps
serving. The compiled-format cache holds at most CACHE_BYTES (estimated), whatever the count.

The request bounds are checked by the body's validation, so the app here has no model (its
loader fails): a request within every bound gets the 503 of a server without a model.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import numpy as np
import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core import grammar_limits, structured
from doel.serve.core.structured import Grammars
from doel.serve.edge.app import Settings, create_app
from doel.serve.edge.bounds import LIMITS
from doel.serve.edge.refusal import RequestError

BOUNDS = Settings(
    bundle="none",
    max_tools=2,
    max_tool_schema_bytes=200,
    max_input_items=3,
    max_input_bytes=100,
)
ASK = [{"role": "user", "content": "x"}]


def tool(name: str, parameters: dict | None = None, flat: bool = False) -> dict:
    f = {"name": name, "parameters": parameters or {"type": "object"}}
    return {"type": "function", **f} if flat else {"type": "function", "function": f}


def no_model(_settings):
    raise RuntimeError("no model in this test")


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(BOUNDS, loader=no_model)) as c:
        yield c


def _refused(r, param: str, flag: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert flag in error["message"] and "\n" not in error["message"]
    return error["message"]


def _within(r) -> None:
    assert r.status_code == 503, r.text  # validated; refused only for want of a model


def test_the_tools_count_and_a_tool_schema_size_are_bounded_on_chat_and_responses(client):
    chat = {"messages": ASK}
    three = [tool(f"f{i}") for i in range(3)]
    r = client.post("/v1/chat/completions", json=chat | {"tools": three})
    assert "3 tools" in _refused(r, "tools", "--max-tools")
    _within(client.post("/v1/chat/completions", json=chat | {"tools": three[:2]}))
    flat = [tool(f"f{i}", flat=True) for i in range(3)]
    r = client.post("/v1/responses", json={"input": "x", "tools": flat})
    _refused(r, "tools", "--max-tools")
    _within(client.post("/v1/responses", json={"input": "x", "tools": flat[:2]}))

    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(12)}}
    r = client.post("/v1/chat/completions", json=chat | {"tools": [tool("f"), tool("g", big)]})
    message = _refused(r, "tools", "--max-tool-schema-bytes")
    assert message.startswith("tools.1.function.parameters")  # which tool
    r = client.post("/v1/responses", json={"input": "x", "tools": [tool("g", big, flat=True)]})
    _refused(r, "tools", "--max-tool-schema-bytes")
    small = {"type": "object", "properties": {"p": {"type": "string"}}}
    _within(client.post("/v1/chat/completions", json=chat | {"tools": [tool("g", small)]}))


def test_the_responses_input_items_and_their_bytes_are_bounded(client):
    item = {"role": "user", "content": "x"}
    r = client.post("/v1/responses", json={"input": [item] * 4})
    assert "4 input items" in _refused(r, "input", "--max-input-items")
    _within(client.post("/v1/responses", json={"input": [item] * 3}))
    # Bytes, not characters: 40 Bangla letters are 120 bytes.
    r = client.post("/v1/responses", json={"input": "ক" * 40})
    _refused(r, "input", "--max-input-bytes")
    _within(client.post("/v1/responses", json={"input": "x" * 100}))
    parts = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 40}]
    output = {"type": "function_call_output", "call_id": "c", "output": "z" * 30}
    r = client.post("/v1/responses", json={"input": [*parts, output]})
    _refused(r, "input", "--max-input-bytes")  # counted over every item, outputs too


def test_the_flags_set_each_bound():
    from doel.serve.cli import build_parser, settings_of

    args = build_parser().parse_args(
        ["b", "--max-tools", "3", "--max-input-bytes", "9", "--compile-timeout", "0.5"]
    )
    s = settings_of(args)
    assert (s.max_tools, s.max_input_bytes, s.compile_timeout) == (3, 9, 0.5)


@pytest.fixture(scope="module")
def grammars(tokenizer_path) -> Grammars:
    return Grammars(tokenizer_path.read_text(encoding="utf-8"), 2048)


PATTERNS = {"anyOf": [{"type": "string", "pattern": f"^a{i}[0-9]+x$"} for i in range(200)]}
PROPS = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(300)}}
# A limit each schema passes at this server's values and hits at the small one.
PAST = [
    ("initial_lexer_fuel", 1_000, PATTERNS),
    ("max_grammar_size", 1_000, PROPS),
    ("max_lexer_states", 3, {"type": "number"}),  # hit at the first mask
]


@pytest.mark.parametrize("limit, value, schema", PAST)
def test_a_grammar_past_a_parser_limit_is_a_400_naming_the_limit(
    grammars, monkeypatch, limit, value, schema
):
    grammars.json_schema(schema | {"title": limit})  # a schema of its own: not from the cache
    monkeypatch.setitem(grammar_limits.PARSER_LIMITS, limit, value)
    with pytest.raises(RequestError) as e:
        grammars.json_schema(schema | {"description": limit}, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format"
    assert f"grammar limit {limit} ({value:,})" in e.value.message
    assert "\n" not in e.value.message


def test_the_compiled_cache_is_bounded_in_bytes_whatever_the_count(grammars, monkeypatch):
    monkeypatch.setattr(structured, "CACHE_BYTES", 4 << 20)
    monkeypatch.setattr(grammars, "_cache", type(grammars._cache)())
    monkeypatch.setattr(grammars, "cache_bytes", 0)

    def large(i: int) -> dict:  # about 20 KiB of schema: ~0.7 MB estimated
        props = {f"k{i}_{j}": {"type": "integer"} for j in range(600)}
        return {"type": "object", "properties": props}

    first = weakref.ref(grammars.json_schema(large(0)))
    for i in range(1, 24):
        grammars.json_schema(large(i))
        assert grammars.cache_bytes <= structured.CACHE_BYTES
    assert grammars.cache_bytes == sum(f.size for f in grammars._cache.values())
    assert 2 <= len(grammars._cache) < 10, len(grammars._cache)
    assert grammars.json_schema(large(23)) is grammars._cache[next(reversed(grammars._cache))]
    gc.collect()
    assert first() is None  # evicted, and its matcher freed
    monkeypatch.setattr(structured, "CACHE_BYTES", 64 << 10)  # smaller than any entry
    tiny = {"type": "string", "maxLength": 3}
    once = grammars.json_schema(tiny)
    assert once.size > structured.CACHE_BYTES and grammars.json_schema(tiny) is not once


def test_a_compile_past_the_timeout_is_a_400_and_the_loop_serves_meanwhile():
    def slow():
        time.sleep(1.5)
        return "compiled"

    async def main():
        ticks, token = [], LIMITS.set(Settings(bundle="none", compile_timeout=0.3))

        async def tick():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        try:
            t0 = time.perf_counter()
            with pytest.raises(RequestError) as e:
                await grammar_limits.compiled("response_format", slow)
            waited = time.perf_counter() - t0
            assert await grammar_limits.compiled("response_format", lambda: "fast") == "fast"
        finally:
            ticker.cancel()
            LIMITS.reset(token)
        return e.value, waited, ticks

    error, waited, ticks = asyncio.run(main())
    assert error.status == 400 and error.param == "response_format"
    assert "--compile-timeout" in error.message and "0.3 s" in error.message
    assert 0.3 <= waited < 1.0  # not the compile's 1.5 s
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 10 and max(gaps) < 0.2  # the loop kept running


def test_the_serving_page_states_each_bound_as_the_code_sets_it():
    """docs/serving.md's "What a request may ask for": each flag's row gives its Settings default,
    each engine limit its PARSER_LIMITS value, and the cache its two bounds."""
    from pathlib import Path

    from doel.serve.endpoints.protocol import MAX_PROMPTS, MAX_STOP_CHARS, MAX_STOPS

    page = (Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text("utf-8")
    section = page.split("## What a request may ask for")[1].split("\n## ")[0]
    rows = {line.split("|")[2].strip(): line for line in section.splitlines() if "| `" in line}
    flags = ["max_body_bytes", "max_headers", "client_request_rate", "client_body_rate"]
    flags += ["max_queue", "max_messages", "max_tools", "max_tool_schema_bytes"]
    flags += ["max_input_items", "max_input_bytes"]
    for name in flags:
        flag = f"`--{name.replace('_', '-')}`"
        (row,) = [r for bound, r in rows.items() if bound.startswith(flag)]
        assert f"{flag} {getattr(Settings(bundle='x'), name):,}" in row, row
    assert f"`--compile-timeout` {Settings.compile_timeout:g} s" in section
    for limit, value in grammar_limits.PARSER_LIMITS.items():
        assert f"| `{limit}` | {value:,} |" in section, limit
    assert f"{structured.MAX_SCHEMA_CHARS:,} characters" in section
    assert (
        f"{MAX_STOPS}, of {MAX_STOP_CHARS} characters" in section
        and f"| {MAX_PROMPTS} |" in section
    )
    cache = f"at most {structured.CACHE_SIZE} of them and {structured.CACHE_BYTES >> 20} MiB"
    assert cache in " ".join(section.split())


def test_a_recursion_with_no_way_out_reaches_a_limit_as_a_dead_end_not_an_error(grammars):
    """{"k": {"k": ...}} forever: every step allows a token, so no compile-time check refuses
    it, and the parse grows until an engine limit stops it. That is a dead end of the row (the
    scheduler ends it "length"), not a RuntimeError (a 500 before: found by
    tests/serve/core/test_schema_property.py)."""
    loop = {"$ref": "#/$defs/a"}
    schema = {"$defs": {"a": {"type": "object", "properties": {"k": loop}, "required": ["k"]}}}
    c = grammars.json_schema(schema | loop).start()
    logits = np.linspace(0.0, 1.0, grammars.vocab_size, dtype=np.float32)
    with pytest.raises(structured.DeadEnd, match="limit"):
        for _ in range(200):
            c.fill()
            c.advance(int(np.argmax(c.mask(logits, ()))))


def plant_a_hanging_compile(monkeypatch, seconds: float) -> None:
    """JSON schemas titled "slow" take `seconds` to compile; the others compile as they do."""
    compile_ = Grammars.json_schema

    def hanging(self, schema, param="response_format"):
        if schema.get("title") == "slow":
            time.sleep(seconds)
        return compile_(self, schema, param)

    monkeypatch.setattr(Grammars, "json_schema", hanging)


def test_a_slow_compile_through_the_app_is_a_400_and_health_answers_meanwhile(
    tiny_bundle, monkeypatch
):
    """A compile that hangs (planted: 3 s of sleep) is refused at --compile-timeout, naming
    the parameter and the flag, while /health keeps answering at once."""
    import threading

    plant_a_hanging_compile(monkeypatch, 3)
    settings = Settings(bundle=str(tiny_bundle), threads=1, compile_timeout=0.5)
    with TestClient(create_app(settings)) as c:
        ready(c)
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"title": "slow"}}}
        body = {"prompt": "x", "max_tokens": 4, "response_format": rf}
        got = {}

        def post():
            t0 = time.monotonic()
            got["r"], got["s"] = c.post("/v1/completions", json=body), time.monotonic() - t0

        slow = threading.Thread(target=post)
        slow.start()
        health = []
        while slow.is_alive():
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            health.append(time.monotonic() - t0)
        slow.join()
    r = got["r"]
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "--compile-timeout" in error["message"]
    assert 0.5 <= got["s"] < 2.5  # refused at the bound, not after the compile's 3 s
    assert len(health) >= 3 and max(health) < 0.25, health


def test_service_complete_bounds_a_compile_it_is_left_to_make(tiny_bundle, monkeypatch):
    """A caller of Service.complete that passes no compiled format gets the same time bound as
    the routes: a hanging compile is a 400 naming --compile-timeout, not a wait."""
    from tokenizers import Tokenizer

    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.service import Service
    from doel.serve.endpoints.protocol import CompletionRequest

    plant_a_hanging_compile(monkeypatch, 2)
    bundle = read_bundle(tiny_bundle)
    svc = Service(Engine(bundle, threads=1), Tokenizer.from_file(str(bundle.tokenizer)), "m")
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"title": "slow"}}}
    req = CompletionRequest(prompt="x", max_tokens=2, response_format=rf)

    async def main():
        token = LIMITS.set(Settings(bundle="none", compile_timeout=0.3))
        try:
            t0 = time.perf_counter()
            with pytest.raises(RequestError) as e:
                async for _ in svc.complete(req):
                    pass
            return e.value, time.perf_counter() - t0
        finally:
            LIMITS.reset(token)

    error, waited = asyncio.run(main())
    assert error.status == 400 and "--compile-timeout" in error.message
    assert waited < 1.5  # not the compile's 2 s
