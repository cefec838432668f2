"""POST /v1/messages and /v1/messages/count_tokens with the official `anthropic` client on a live
doel-serve guarded by two keys: a plain Message (the chat route's greedy reply, in Anthropic's
shape), max_tokens and stop_sequences as stop reasons, the raw event stream in its order and the
client's streaming helper accumulating the same Message as the non-streamed one, tools (`any`,
a named `tool` streamed, `none`, a tool_result sent back), count_tokens equal to the usage, the
key from x-api-key or Authorization with the prefix cache per tenant, the client's exceptions
for the 4xx (every body in Anthropic's error shape, a 429 from the rate limit included), and
/metrics counting the routes. A stream that fails after it began ends with an `error` event."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest
from live_server import live_server
from long_bundle import long_bundle

from doel.serve.core.service import Piece, RequestError
from doel.serve.endpoints.chat import tools
from doel.serve.endpoints.messages import route
from doel.serve.endpoints.messages.protocol import MessagesRequest

anthropic = pytest.importorskip("anthropic", reason="the dev extra: pip install 'doel[dev]'")
openai = pytest.importorskip("openai", reason="the dev extra: pip install 'doel[dev]'")
jsonschema = pytest.importorskip("jsonschema")

KEYS = "alice:key-a\nbob:key-b\n"
RATE = 3  # requests a second a tenant may send, a burst of 10 s of them (ratelimit.py)
ASK = [{"role": "user", "content": "নদীর নাম বলো"}]
ADD = {
    "name": "add",
    "description": "Add two numbers",
    "input_schema": {
        "type": "object",
        # bounded: a call cannot run past max_tokens
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
EVENTS = ["message_start", "ping", "content_block_start", "content_block_delta"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_path, tiny_model_config):
    bundle = long_bundle(tmp_path_factory, tokenizer_path, tiny_model_config)
    folder = tmp_path_factory.mktemp("messages")
    (folder / "keys").write_text(KEYS, encoding="utf-8")
    args = ["--api-key-file", str(folder / "keys"), "--client-request-rate", str(RATE)]
    with live_server(bundle, folder, *args) as s:
        s.model = bundle.name
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def _client(server, **key):
    http = anthropic.DefaultHttpxClient(trust_env=False)
    return anthropic.Anthropic(
        base_url=server.url, max_retries=0, timeout=30, http_client=http, **key
    )


@pytest.fixture(scope="module")
def client(server):
    c = _client(server, api_key="key-a")  # sent as x-api-key
    c.model = server.model
    yield c
    c.close()


# Sampled with a seed (the tiny random model's greedy reply is no text): the same reply each
# time. The 2.x client sends sampling fields only as extra_body.
GREEDY = {"seed": 7, "top_k": 40}


def _greedy(client, **kw):
    body = {"model": client.model, "max_tokens": 6, "extra_body": GREEDY, "messages": ASK} | kw
    return client.messages.create(**body)


def _text(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


@pytest.mark.slow  # a live server
def test_a_message_is_the_chat_routes_greedy_reply_in_anthropics_shape(client, server):
    m = _greedy(client, system="ছোট করে বলো")
    with openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="key-a",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    ) as oc:
        chat = oc.chat.completions.create(
            model=client.model, max_tokens=6, extra_body=GREEDY,
            messages=[{"role": "system", "content": "ছোট করে বলো"}, *ASK],
        )  # fmt: skip
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == client.model
    assert _text(m) == chat.choices[0].message.content and _text(m)
    # Cut by max_tokens; input_tokens are those the prefix cache did not hold
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 6 == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow  # a live server
def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client):
    whole = _text(_greedy(client, max_tokens=24))
    stop = next(c for c in whole[1:] if c.isalpha())  # a letter the greedy reply writes
    m = _greedy(client, max_tokens=24, stop_sequences=[stop, "never said"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == whole[: whole.index(stop)]


@pytest.mark.slow  # a live server
def test_the_stream_is_anthropics_event_sequence_and_accumulates_the_same_message(client):
    kw = {"model": client.model, "max_tokens": 12, "extra_body": GREEDY, "messages": ASK}
    raw = [e.type for e in client.messages.create(stream=True, **kw)]
    # the client passes on every event but ping (the unit test below sees it)
    assert raw[:3] == [e for e in EVENTS if e != "ping"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[3:-3]) == {"content_block_delta"}  # one text block
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    whole = client.messages.create(**kw)
    # the same Message but for its id (and the cache, warm by now in both)
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert streamed.stop_reason == "max_tokens" and _text(streamed)


@pytest.mark.slow  # a live server
def test_tool_choice_any_calls_with_input_that_validates_and_a_result_goes_back(client):
    m = _greedy(client, max_tokens=40, tools=[ADD], tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD["input_schema"])
    answer = {"type": "tool_result", "tool_use_id": call.id, "content": "42"}
    turns = [
        *ASK,
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [answer]},
    ]
    back = _greedy(client, messages=turns, tools=[ADD])
    counted = client.messages.count_tokens(model=client.model, messages=turns, tools=[ADD])
    used = back.usage.input_tokens + back.usage.cache_read_input_tokens
    assert counted.input_tokens == used > m.usage.input_tokens
    none = _greedy(client, tools=[ADD], tool_choice={"type": "none"})
    assert none.stop_reason != "tool_use" and all(b.type == "text" for b in none.content)


@pytest.mark.slow  # a live server
def test_a_named_tool_streams_input_json_deltas_and_accumulates_the_whole_call(client):
    kw = {
        "model": client.model, "max_tokens": 40, "extra_body": GREEDY, "messages": ASK,
        "tools": [ADD], "tool_choice": {"type": "tool", "name": "add"},
    }  # fmt: skip
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert "input_json" in kinds and streamed.stop_reason == "tool_use"
    whole = client.messages.create(**kw)
    (a,), (b,) = streamed.content, whole.content
    assert (a.type, a.name, a.input) == (b.type, b.name, b.input) == ("tool_use", "add", a.input)
    jsonschema.validate(a.input, ADD["input_schema"])


@pytest.mark.slow  # a live server
def test_count_tokens_is_the_prompt_the_message_reads(client):
    counted = client.messages.count_tokens(model=client.model, messages=ASK, system="ছোট")
    m = _greedy(client, system="ছোট", max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


@pytest.mark.slow  # a live server
def test_keys_come_from_either_header_and_the_prefix_cache_is_the_tenants(client, server):
    turns = [{"role": "user", "content": "একটি লম্বা প্রশ্ন, যার শুরু আগে দেখা হয়নি " * 4}]
    first, again = _greedy(client, messages=turns), _greedy(client, messages=turns)
    assert first.usage.cache_read_input_tokens == 0 < again.usage.cache_read_input_tokens
    with _client(server, auth_token="key-b") as bob:  # Authorization: Bearer
        other = bob.messages.create(
            model=server.model, max_tokens=6, extra_body=GREEDY, messages=turns
        )
    assert other.usage.cache_read_input_tokens == 0  # alice's prefix is not bob's
    assert _text(other) == _text(first)


def _refused(call, exc, kind: str) -> str:
    with pytest.raises(exc) as e:
        call()
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == kind
    assert set(e.value.body) == {"type", "error"}
    return e.value.body["error"]["message"]


@pytest.mark.slow  # a live server
def test_every_refusal_is_the_clients_exception_with_anthropics_error_body(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    said = _refused(
        lambda: _greedy(client, messages=[{"role": "user", "content": [image]}]),
        anthropic.BadRequestError,
        "invalid_request_error",
    )
    assert "'image'" in said
    said = _refused(
        lambda: client.messages.create(model=client.model, messages=ASK, max_tokens=0),
        anthropic.BadRequestError,
        "invalid_request_error",
    )
    assert "max_tokens" in said
    said = _refused(
        lambda: client.messages.create(model="claude-x", messages=ASK, max_tokens=4),
        anthropic.NotFoundError,
        "not_found_error",
    )
    assert "claude-x" in said
    with _client(server, api_key="wrong") as bad:
        _refused(
            lambda: bad.messages.create(model=server.model, messages=ASK, max_tokens=4),
            anthropic.AuthenticationError,
            "authentication_error",
        )


@pytest.mark.slow  # a live server
def test_a_tenant_past_its_rate_gets_a_429_in_anthropics_shape(server):
    with _client(server, api_key="key-b") as bob:

        def flood():
            for _ in range(RATE * 12):
                bob.messages.count_tokens(model=server.model, messages=ASK)

        said = _refused(flood, anthropic.RateLimitError, "rate_limit_error")
    assert "--client-request-rate" in said


@pytest.mark.slow  # a live server
def test_metrics_count_the_messages_routes(client, server):
    _greedy(client, max_tokens=1)
    headers = {"x-api-key": "key-a"}
    with httpx2.Client(base_url=server.url, trust_env=False, timeout=30) as http:
        text = http.get("/metrics", headers=headers).text
    assert 'route="/v1/messages",status="200"' in text
    assert 'route="/v1/messages/count_tokens",status="429"' in text


class _Svc:
    name = "m"


async def _failing():
    yield Piece("ঢাকা")
    raise RequestError(500, "the engine failed", kind="server_error")


def test_a_stream_that_fails_after_it_began_ends_with_an_error_event():
    req = MessagesRequest(max_tokens=4, messages=ASK, stream=True)

    async def events():
        out = []
        with pytest.raises(RequestError):
            async for e in route.stream(_Svc(), req, _failing()):
                out.append(e)
        return out

    said = asyncio.run(events())
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in said]
    assert kinds == [*EVENTS, "error"]
    last = json.loads(said[-1].split("data: ", 1)[1])
    assert last == {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}}


@pytest.mark.parametrize(
    ("piece", "mode", "said"),
    [
        (Piece("", "stop"), "text", ("end_turn", None)),
        (Piece("", "length"), "text", ("max_tokens", None)),
        (Piece("", "stop", stop="।"), "text", ("stop_sequence", "।")),
        (Piece("", "stop"), "named", ("tool_use", None)),
        (Piece("", "length"), "named", ("max_tokens", None)),  # a call cut short
    ],
)
def test_the_stop_reason_is_anthropics_for_each_end(piece, mode, said):
    plan = tools.ToolPlan(mode, name="add", names={"add"})
    assert route._end(piece, tools.Deltas(plan))[1:] == said
