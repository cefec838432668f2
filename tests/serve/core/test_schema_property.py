"""Hostile schemas through a live doel-serve, as a property (issue 48, point 3): random JSON
schemas (nesting, `$ref`s with and without cycles, anyOf/allOf/oneOf, enums, patterns, numeric and
length bounds, impossible combinations) as `response_format`, and as the parameters of tools
with `tool_choice: "required"`. Every answer is a 400 in the OpenAI error shape or a 200 whose
"stop" document (a call's arguments, for tools) validates with the jsonschema package: never a
5xx, never a hang (each request has a deadline), and the server logs no traceback.
Derandomized: CI sees the same schemas every run.
"""

from __future__ import annotations

import json
from decimal import Decimal

import httpx2
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import live_server
from long_bundle import long_bundle

EXAMPLES = 30  # each test; a request is a compile and at most MAX_TOKENS tokens
MAX_TOKENS = 24
DEADLINE = 20.0  # seconds a request may take; more is a hang (the test fails)
ASK = [{"role": "user", "content": "তথ্য দাও"}]
DEFS = ("a", "b")  # the names a $ref may point at; not always defined
PROPERTY = st.sampled_from(["x", "নাম", "n", "ok"])
WORDS = st.sampled_from(["ঢাকা", "নদী", "river", "", "a b"])
PATTERNS = st.sampled_from(["^[a-z]{1,4}$", "^(ঢাকা|খুলনা)$", "^[0-9]{2}-[0-9]$", "^x*$", "^$"])


def leaves() -> st.SearchStrategy[dict]:
    """Scalar schemas; their bounds drawn independently, so that some admit nothing."""
    small, length = st.integers(-5, 5), st.integers(0, 5)
    return st.one_of(
        st.builds(lambda a, b: {"type": "string", "minLength": a, "maxLength": b}, length, length),
        st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
        st.builds(lambda a, b: {"type": "integer", "minimum": a, "maximum": b}, small, small),
        st.builds(
            lambda a, b: {"type": "number", "exclusiveMinimum": a, "maximum": b}, small, small
        ),
        st.builds(lambda m: {"type": "integer", "multipleOf": m, "maximum": 40}, st.integers(1, 7)),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, {"const": 3}]),
        st.builds(lambda v: {"enum": v}, st.lists(WORDS | small, max_size=3)),  # [] too
        st.builds(lambda n: {"$ref": f"#/$defs/{n}"}, st.sampled_from(DEFS)),
    )


def composites(inner: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def obj(props: dict, required: list) -> dict:
        keys = [k for k in required if k in props] or list(props)[:1]
        return {"type": "object", "properties": props, "required": keys,
                "additionalProperties": False}  # fmt: skip

    def arr(items: dict, least: int, most: int) -> dict:
        return {"type": "array", "items": items, "minItems": least, "maxItems": most}

    branches = st.lists(inner, min_size=1, max_size=3)
    return st.one_of(
        st.builds(
            obj,
            st.dictionaries(PROPERTY, inner, min_size=1, max_size=3),
            st.lists(PROPERTY, max_size=3, unique=True),
        ),  # fmt: skip
        st.builds(arr, inner, st.integers(0, 2), st.integers(0, 3)),
        st.builds(lambda bs: {"anyOf": bs}, branches),
        st.builds(lambda bs: {"allOf": bs}, branches),
        st.builds(lambda bs: {"oneOf": bs}, branches),
    )


NODES = st.recursive(leaves(), composites, max_leaves=5)
# Fixed shapes among the random ones: cycles with and without a way out.
LOOP = {"$ref": "#/$defs/a"}
CYCLES = [
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": LOOP}} | LOOP,
    {"$defs": {"a": {"type": "object", "properties": {"k": LOOP}, "required": ["k"]}}} | LOOP,
    {"$defs": {"a": {"anyOf": [{"type": "null"}, {"type": "array", "items": LOOP}]}}} | LOOP,
]


def with_defs(defs: dict, body: dict) -> dict:
    return {"$defs": defs, **body} if defs else body


SCHEMAS = st.builds(with_defs, st.dictionaries(st.sampled_from(DEFS), NODES, max_size=2), NODES)
SCHEMAS = SCHEMAS | st.sampled_from(CYCLES)
PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,  # each request has its own (DEADLINE)
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_path, tiny_model_config):
    bundle = long_bundle(tmp_path_factory, tokenizer_path, tiny_model_config)
    with live_server(bundle, tmp_path_factory.mktemp("schemas")) as s:
        with httpx2.Client(base_url=s.url, trust_env=False, timeout=DEADLINE) as http:
            yield http
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def answer(http, body: dict, max_tokens: int = MAX_TOKENS) -> dict | None:
    """The 200's body, or None for a 400 in the OpenAI error shape; anything else fails (a
    request past DEADLINE raises httpx's timeout)."""
    r = http.post("/v1/chat/completions", json=body | {"messages": ASK, "max_tokens": max_tokens})
    if r.status_code == 400:
        error = r.json()["error"]
        assert set(r.json()) == {"error"} and error["type"] == "invalid_request_error", r.text
        assert error["message"] and "\n" not in error["message"], r.text
        return None
    assert r.status_code == 200, (r.status_code, r.text, body)
    return r.json()


def valid(document: str, schema: dict) -> None:
    # Decimal: a number is compared as written, not as the float nearest to it.
    jsonschema.validate(json.loads(document, parse_float=Decimal), schema)


@pytest.mark.slow  # builds the long bundle, starts doel-serve
def test_a_random_response_format_is_a_400_or_a_document_of_its_schema(server):
    outcomes = []

    @PROPERTY_SETTINGS
    @given(SCHEMAS, st.integers(0, 1 << 20))
    def one(schema: dict, seed: int) -> None:
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        body = answer(server, {"response_format": rf, "temperature": 1.0, "seed": seed})
        choice = body and body["choices"][0]
        outcomes.append("400" if body is None else choice["finish_reason"])
        if choice and choice["finish_reason"] == "stop":
            valid(choice["message"]["content"], schema)

    one()
    # Not passed vacuously: some refused, some whole documents checked.
    assert outcomes.count("400") >= 3 and outcomes.count("stop") >= 5, outcomes


def tool(name: str, schema: dict) -> dict:
    """A function whose arguments are an object holding `schema` (its $defs at the top)."""
    defs = schema.get("$defs")
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    params = {"type": "object", "properties": {"v": inner}, "required": ["v"],
              "additionalProperties": False}  # fmt: skip
    return {"type": "function", "function": {"name": name, "parameters": with_defs(defs, params)}}


@pytest.mark.slow
def test_random_tool_schemas_with_a_required_call_are_a_400_or_a_valid_call(server):
    outcomes = []

    @PROPERTY_SETTINGS
    @given(st.lists(SCHEMAS, min_size=1, max_size=2), st.integers(0, 1 << 20))
    def one(schemas: list[dict], seed: int) -> None:
        tools = [tool(f"f{i}", s) for i, s in enumerate(schemas)]
        body = {"tools": tools, "tool_choice": "required", "temperature": 1.0, "seed": seed}
        body = answer(server, body, 2 * MAX_TOKENS)  # room for the call's name as well
        choice = body and body["choices"][0]
        outcomes.append("400" if body is None else choice["finish_reason"])
        if choice and choice["finish_reason"] == "tool_calls":
            (call,) = choice["message"]["tool_calls"]
            params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            valid(call["function"]["arguments"], params[call["function"]["name"]])

    one()
    assert outcomes.count("400") >= 3 and outcomes.count("tool_calls") >= 5, outcomes
