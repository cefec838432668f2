"""A format that admits no document is a 400 before any work, and a grammar that dead-ends while
decoding ends that row only (issue 48, point 1). A schema whose `$ref`s form a cycle with no
base case compiles in llguidance, but its first mask allows nothing: refused when compiled,
naming the parameter (response_format, a tool's parameters, the Responses API's text.format),
in the OpenAI error shape, streamed or not. A dead end no compile can see (planted here) ends
its row with "length" while the other rows of the same steps carry on."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from long_bundle import long_bundle
from ready import ready

from doel.serve.core import structured
from doel.serve.core.service import RequestError, Service
from doel.serve.edge.app import Settings, create_app
from doel.serve.endpoints.protocol import CompletionRequest

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# A recursive tree with a way out (children may be empty): a real document, not refused.
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 4},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
            },
            "required": ["name"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
ASK = [{"role": "user", "content": "ঢাকার আবহাওয়া কেমন?"}]


def rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def svc(tiny_bundle) -> Service:
    return Service.load(str(tiny_bundle), threads=1, slots=4)


@pytest.fixture(scope="module")
def client(tmp_path_factory, tokenizer_path, tiny_model_config):
    """The app on a bundle whose context holds a prompt with tool definitions."""
    bundle = long_bundle(tmp_path_factory, tokenizer_path, tiny_model_config)
    with TestClient(create_app(Settings(bundle=str(bundle), threads=1))) as c:
        ready(c)
        yield c


def test_a_ref_cycle_without_a_base_case_is_refused_when_compiled_and_a_tree_is_not(svc):
    with pytest.raises(RequestError) as e:
        svc.grammars.response_format(rf(CYCLE))
    assert e.value.status == 400 and e.value.param == "response_format.json_schema.schema"
    assert "admits no document" in e.value.message and "\n" not in e.value.message
    fmt = svc.grammars.response_format(rf(TREE))  # compiles, and its copies still start clean
    c = fmt.start()
    c.fill()
    assert not c.matcher.is_error()
    assert svc.grammars.response_format(rf(TREE)) is fmt  # the probe left the cache intact


def _error(r) -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.slow  # builds the long bundle
@pytest.mark.parametrize("stream", [False, True])
def test_every_route_refuses_a_format_that_admits_no_document_naming_it(client, stream):
    base = {"max_tokens": 8, "stream": stream}
    r = client.post("/v1/completions", json=base | {"prompt": "x", "response_format": rf(CYCLE)})
    assert _error(r)["param"] == "response_format.json_schema.schema"
    chat = base | {"messages": ASK}
    r = client.post("/v1/chat/completions", json=chat | {"response_format": rf(CYCLE)})
    assert _error(r)["param"] == "response_format.json_schema.schema"
    # A named tool, and the second of two required tools (the grammar of both would still
    # admit the first one's calls).
    named = {"type": "function", "function": {"name": "loop"}}
    r = client.post(
        "/v1/chat/completions", json=chat | {"tools": [tool("loop", CYCLE)], "tool_choice": named}
    )
    assert _error(r)["param"] == "tools[0].function.parameters"
    both = [tool("ok", {"type": "object"}), tool("loop", {"type": "object"} | CYCLE)]
    r = client.post("/v1/chat/completions", json=chat | {"tools": both, "tool_choice": "required"})
    assert _error(r)["param"] == "tools[1].function.parameters"
    text = {"format": {"type": "json_schema", "name": "s", "schema": CYCLE}}
    r = client.post("/v1/responses", json={"input": "x", "stream": stream, "text": text})
    assert "text.format" in _error(r)["param"]
    assert client.get("/health").status_code == 200  # and the server carries on


def test_a_dead_end_while_decoding_ends_that_row_with_length_and_not_the_others(svc, monkeypatch):
    """A planted dead end: the mask of one request's constraint allows nothing at its third
    token. That request ends "length" with what it had; the plain request decoded in the same
    steps gets exactly what it gets alone; no exception reaches either."""
    plain = CompletionRequest(prompt="নদীর ধারে", temperature=0, max_tokens=12)

    async def alone():
        return [p async for p in svc.complete(plain)]

    first = asyncio.run(alone())
    calls = {"n": 0}
    mask = structured.Constraint.mask

    def dead_at_three(self, logits, stop_ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise structured.DeadEnd("the grammar allows no token: planted")
        return mask(self, logits, stop_ids)

    monkeypatch.setattr(structured.Constraint, "mask", dead_at_three)
    never_done = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    formatted = CompletionRequest(prompt="x", max_tokens=40, response_format=rf(never_done))

    async def together():
        async def run(req):
            return [p async for p in svc.complete(req)]

        return await asyncio.gather(run(plain), run(formatted))

    beside, dead = asyncio.run(together())
    assert calls["n"] == 3  # the dead end was reached, and the row asked for no more masks
    assert dead[-1].finish_reason == "length"
    assert json.dumps("".join(p.text for p in dead)).startswith('"[')  # what it had, kept
    assert [p.text for p in beside] == [p.text for p in first]
    assert beside[-1].finish_reason == first[-1].finish_reason
