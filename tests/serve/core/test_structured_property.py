"""Structured output fails closed, as a property: 200 random JSON schemas (objects, arrays, enums
with Bangla, nesting, required fields, string patterns, bounded numbers) sampled at temperature 1
from the tiny model, eight at a time through the batched scheduler. Every output that ends with
"stop" parses and validates with the jsonschema package; a schema with a feature the engine
cannot enforce is a 400 naming it, before any work."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from doel.serve.core.service import RequestError, Service
from doel.serve.endpoints.protocol import CompletionRequest

BATCH = 8  # the engine's slots: a batch of schemas shares every decode step
EXAMPLES = 25  # batches: 200 schemas
MAX_TOKENS = 48

KEYS = st.sampled_from(["a", "name", "n", "শহর", "নাম", "ok", "items", "x_1"])
WORDS = st.sampled_from(["ঢাকা", "চট্টগ্রাম", "নদী", "Sylhet", "river", "a b", "১২৩"])
PATTERNS = st.sampled_from(
    ["^[a-z]{1,4}$", "^[0-9]{2}-[0-9]{2}$", "^(ঢাকা|খুলনা)$", "^[A-Z][a-z]?$", "^x*$"]
)
# Features llguidance refuses, and the word its refusal names.
UNSUPPORTED = [
    ({"not": {"type": "string"}}, "not"),
    ({"dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "pattern": "^(?!x)"}, "look-around"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
]


def leaves() -> st.SearchStrategy[dict]:
    ints = st.integers(-50, 50)
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
        st.builds(lambda p: {"type": "string", "pattern": p}, PATTERNS),
        st.builds(
            lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)}, ints, ints
        ),  # fmt: skip
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda v: {"enum": v}, st.lists(WORDS | ints, min_size=1, max_size=4)),
        st.builds(lambda v: {"const": v}, WORDS),
    )


def objects(inner: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(props: dict, required: list, closed: bool) -> dict:
        schema = {"type": "object", "properties": props, "additionalProperties": not closed}
        schema["required"] = [k for k in props if k in required]
        return schema if not closed else schema | {"additionalProperties": False}

    props = st.dictionaries(KEYS, inner, min_size=1, max_size=3)
    closed = st.sampled_from([True, True, False])  # open ones let the model add keys
    return st.builds(build, props, st.lists(KEYS, max_size=3), closed)


def arrays(inner: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.builds(
        lambda items, most: {"type": "array", "items": items, "maxItems": most},
        inner,
        st.integers(0, 3),
    )


NESTED = st.recursive(leaves(), lambda inner: objects(inner) | arrays(inner), max_leaves=4)
SCHEMAS = objects(NESTED) | arrays(NESTED) | leaves()  # mostly containers, as clients send


@pytest.fixture(scope="module")
def svc(tiny_bundle) -> Service:
    return Service.load(str(tiny_bundle), threads=1, slots=BATCH)


async def one(svc: Service, schema: dict, seed: int) -> tuple[str, str]:
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    req = CompletionRequest(prompt="তথ্য:", temperature=1.0, max_tokens=MAX_TOKENS, seed=seed,
                            response_format=rf)  # fmt: skip
    pieces = [p async for p in svc.complete(req)]
    return "".join(p.text for p in pieces), pieces[-1].finish_reason


def test_every_stopped_output_of_200_random_schemas_parses_and_validates(svc):
    outcomes: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.lists(SCHEMAS, min_size=BATCH, max_size=BATCH), st.integers(0, 1 << 30))
    def batch(schemas: list[dict], seed: int) -> None:
        async def run():
            return await asyncio.gather(*(one(svc, s, seed + i) for i, s in enumerate(schemas)))

        for schema, (text, reason) in zip(schemas, asyncio.run(run())):
            outcomes.append(reason)
            assert reason in ("stop", "length")
            if reason == "stop":  # fails closed: a "stop" is always a valid document
                jsonschema.validate(json.loads(text), schema)

    batch()
    assert len(outcomes) == BATCH * EXAMPLES
    # Most end within max_tokens, so the property is tested, not passed vacuously.
    assert outcomes.count("stop") >= len(outcomes) // 2, outcomes.count("stop")


@pytest.mark.parametrize("bad, named", UNSUPPORTED)
def test_unsupported_features_anywhere_in_a_schema_are_a_400_naming_them(svc, bad, named):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": bad}}}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    req = CompletionRequest(prompt="x", max_tokens=4, response_format=rf)

    async def run():
        return [p async for p in svc.complete(req)]

    with pytest.raises(RequestError) as e:
        asyncio.run(run())
    assert e.value.status == 400 and named in e.value.message
    assert e.value.param == "response_format.json_schema.schema"


def test_a_row_without_a_format_pays_nothing_and_gets_what_it_gets_alone(svc, monkeypatch):
    from doel.serve.core import step

    calls = []
    fill_all = step.fill_all
    monkeypatch.setattr(step, "fill_all", lambda cs: calls.append(len(cs)) or fill_all(cs))
    plain = CompletionRequest(prompt="নদীর ধারে", temperature=0, max_tokens=20)

    async def alone():
        return [p async for p in svc.complete(plain)]

    async def beside_three():
        long = {"type": "array", "items": {"type": "integer"}, "minItems": 100}  # never done
        texts = [one(svc, long, i) for i in range(3)]
        return await asyncio.gather(alone(), *texts)

    first = asyncio.run(alone())
    assert calls == []  # no mask, no grammar thread, for a request without a format
    together = asyncio.run(beside_three())
    assert [p.text for p in together[0]] == [p.text for p in first]
    assert calls and max(calls) == 3  # the three formatted rows' masks, in one call a step


def test_logprobs_with_a_format_are_those_of_the_masked_distribution(svc):
    from doel.serve.endpoints.completions.route import whole

    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["ঢাকা"]}}}
    req = CompletionRequest(prompt="x", max_tokens=20, logprobs=2, response_format=rf)
    choice = asyncio.run(whole(svc, req)).choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.text) == "ঢাকা"
    # One value allowed: every token is forced, its log-probability 0, no other in the top.
    assert choice.logprobs.token_logprobs == [0.0] * len(choice.logprobs.tokens)
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)
