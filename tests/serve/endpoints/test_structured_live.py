"""response_format against a real doel-serve, driven by the official openai client: a JSON schema
with Bangla enum values, whole and streamed (the chunks concatenate to the document), the
client's own parse() with a pydantic model, json_object on /v1/completions, and the fail-closed
rules: a cut document says "length", a schema the engine cannot enforce and a stop string beside
a format are the client's BadRequestError naming the parameter."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from live_server import live_server
from pydantic import BaseModel

openai = pytest.importorskip("openai", reason="the dev extra: pip install 'doel[dev]'")

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["ঢাকা", "চট্টগ্রাম", "খুলনা"]},
        "rain": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["city", "rain", "note"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY, "strict": True}}
ASK = [{"role": "user", "content": "আজ ঢাকার আবহাওয়া কেমন?"}]


class Weather(BaseModel):
    city: Literal["ঢাকা", "চট্টগ্রাম"]
    rain: bool


@pytest.fixture(scope="module")
def client(tiny_bundle, tmp_path_factory):
    with live_server(tiny_bundle, tmp_path_factory.mktemp("structured")) as server:
        c = openai.OpenAI(
            base_url=f"{server.url}/v1",
            api_key="none",
            max_retries=0,
            timeout=30,
            http_client=openai.DefaultHttpxClient(trust_env=False),  # no proxy for loopback
        )
        yield c
        c.close()
    assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


def test_a_schema_is_followed_whole_and_streamed(client, tiny_bundle):
    for seed in range(3):
        req = dict(model=tiny_bundle.name, messages=ASK, response_format=FORMAT, seed=seed,
                   max_tokens=60, temperature=1.0)  # fmt: skip
        whole = client.chat.completions.create(**req)
        choice = whole.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)
        chunks = list(client.chat.completions.create(**req, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == choice.message.content  # the same seed, the same document
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_the_clients_parse_returns_the_pydantic_model(client, tiny_bundle):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    done = parse(model=tiny_bundle.name, messages=ASK, response_format=Weather, max_tokens=40)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Weather) and parsed.city in ("ঢাকা", "চট্টগ্রাম")


def test_json_object_on_completions_and_a_cut_document_says_length(client, tiny_bundle):
    def complete(rf: dict, max_tokens: int, seed: int):
        return client.completions.create(
            model=tiny_bundle.name, prompt="তথ্য:", max_tokens=max_tokens, seed=seed,
            extra_body={"response_format": rf},  # not a parameter of the legacy API's method
        ).choices[0]  # fmt: skip

    objects = [complete({"type": "json_object"}, 60, seed) for seed in range(4)]
    for o in objects:
        assert o.finish_reason == "length" or isinstance(json.loads(o.text), dict)
    assert "stop" in [o.finish_reason for o in objects]
    cut = complete(FORMAT, 4, 1)  # three required fields cannot fit in 4 tokens
    assert cut.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


def test_what_cannot_be_honoured_is_a_bad_request_naming_it(client, tiny_bundle):
    schema = {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError, match=r'Unimplemented keys: \["not"\]') as e:
        client.chat.completions.create(model=tiny_bundle.name, messages=ASK, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="stop") as e:
        client.chat.completions.create(
            model=tiny_bundle.name, messages=ASK, response_format=FORMAT, stop=["}"]
        )
    assert e.value.body["param"] == "stop"
