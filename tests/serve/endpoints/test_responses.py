"""POST /v1/responses with the official client on a live server: text and message-list input
with instructions (the same prompt as chat's), max_output_tokens cutting a reply into an
"incomplete" Response, the event stream in its order with sequence numbers (raw, and through
the client's own accumulator), text.format json_schema enforced (and parsed into a pydantic
model by `responses.parse`), and the refusals of a stateless text server. Function tools on
this route: tests/serve/endpoints/test_tools.py (their prompts need a longer context than the tiny
bundle's)."""

from __future__ import annotations

import json

import pytest
from live_server import live_server

openai = pytest.importorskip("openai", reason="the dev extra: pip install 'doel[dev]'")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def client(tiny_bundle, tmp_path_factory):
    with live_server(tiny_bundle, tmp_path_factory.mktemp("responses")) as s:
        http = openai.DefaultHttpxClient(trust_env=False)
        c = openai.OpenAI(
            base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=30, http_client=http
        )
        c.model = tiny_bundle.name
        yield c
        c.close()
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def test_a_text_input_with_instructions_is_the_chat_prompt_and_max_output_tokens_cuts_it(client):
    r = client.responses.create(
        model=client.model, input="নদীর নাম বলো", instructions="ছোট করে বলো",
        max_output_tokens=6, temperature=0, store=True,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=client.model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "ছোট করে বলো"},
                  {"role": "user", "content": "নদীর নাম বলো"}],
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_") and r.model == client.model
    assert r.output_text == chat.choices[0].message.content  # greedy: the same reply
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    # Cut by max_output_tokens: incomplete, and said why.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert r.instructions == "ছোট করে বলো" and r.max_output_tokens == 6
    assert r.model_extra.get("store") is False  # accepted, and nothing kept


def test_a_message_list_reads_as_chat_messages_and_output_sent_back(client):
    first = client.responses.create(model=client.model, input="hi", max_output_tokens=4)
    conversation = [
        {"role": "developer", "content": "বাংলায় বলো"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        *[o.model_dump(exclude_none=True) for o in first.output],  # the earlier reply, as is
        {"role": "user", "content": "আবার"},
    ]
    r = client.responses.create(
        model=client.model, input=conversation, max_output_tokens=4, temperature=0
    )
    chat = client.chat.completions.create(
        model=client.model, max_tokens=4,
        messages=[{"role": "system", "content": "বাংলায় বলো"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "আবার"}],
    )  # fmt: skip
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_the_stream_is_the_event_sequence_the_client_expects(client):
    events = list(
        client.responses.create(
            model=client.model, input="নদী", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == EVENTS[:4] + [EVENTS[4]] * deltas + EVENTS[5:] + ["response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text  # the deltas make the text (greedy: 8 tokens, cut)
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 8
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


def test_text_format_json_schema_is_enforced_streamed_and_not(client):
    for seed_input in ("one", "দুই", "three"):
        r = client.responses.create(
            model=client.model, input=seed_input, text=FORMAT, max_output_tokens=40
        )
        assert r.status == "completed" and r.incomplete_details is None
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with client.responses.stream(
        model=client.model, input="নদী", text=FORMAT, max_output_tokens=40
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), SCHEMA)

    class Answer(pydantic.BaseModel):
        ok: bool
        n: int = pydantic.Field(ge=1, le=3)  # bounded: the document ends within the limit

    parsed = client.responses.parse(
        model=client.model, input="নদী", text_format=Answer, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Answer)


def test_what_a_stateless_text_server_cannot_do_is_a_400_naming_the_parameter(client):
    def refused(**body) -> dict:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=client.model, max_output_tokens=4, **body)
        return e.value.body

    err = refused(input="x", previous_response_id="resp_1")
    assert err["param"] == "previous_response_id" and "stateless" in err["message"]
    orphan = {"type": "function_call_output", "call_id": "c", "output": "1"}
    err = refused(input=[{"role": "user", "content": "x"}, orphan])
    assert err["param"] == "input" and "did not call" in err["message"]
    assert "'item_reference'" in refused(input=[{"type": "item_reference", "id": "x"}])["message"]
    hosted = {"type": "web_search"}
    err = refused(input="x", tools=[hosted])
    assert err["param"] == "tools" and "'web_search'" in err["message"]
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}
    assert refused(input="x", text=bad)["param"].startswith("text.format")
