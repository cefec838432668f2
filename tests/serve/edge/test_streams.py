"""How a streamed answer ends when it cannot end well, on the app itself (a TestClient, or the
ASGI call with a `receive` and a `send` of the test's own): an engine failure after the first
event ends the stream with an error event in its protocol's shape (chat and completions: an
OpenAI error object, then [DONE], which the official client raises as APIError; the Responses
API: response.failed), counted in /metrics as the failure it was; a client that stops reading
is let go after --write-timeout; a client that leaves while an event is being written frees
its slot at once, not when the garbage collector finds the stream. In each case the model's
lease ends with the response."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import time

import anyio
import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core.service import Service
from doel.serve.edge.app import Settings, create_app

CHAT = {"messages": [{"role": "user", "content": "নদী"}]}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"prompt": "নদী"},
    "/v1/responses": {"input": "নদী"},
}


def _body(path: str, tokens: int) -> dict:
    """The route's body, streamed, at most `tokens` tokens long."""
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    return BODIES[path] | {"stream": True, limit: tokens}


@contextlib.contextmanager
def serving(tiny_bundle, **settings):
    """A started app on one slot and its Service; the test may slow or break the engine. Every
    request samples with seed 0 (the Responses API takes none), for which the tiny model's
    first token, the prompt's own (no decode step), is text on each route (its greedy chat
    reply has none until the end)."""
    svc = Service.load(str(tiny_bundle), threads=1, slots=1)
    run = svc.run
    svc.run = lambda ids, params, *a, **k: run(ids, dataclasses.replace(params, seed=0), *a, **k)
    app = create_app(Settings(bundle=str(tiny_bundle), **settings), loader=lambda _s: svc)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield ready(c), svc


def _metric(c: TestClient, line_start: str) -> float:
    lines = [x for x in c.get("/metrics").text.splitlines() if x.startswith(line_start)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def _failing_after_the_first_token(svc: Service) -> None:
    """Every decode step fails: the reply's first token (and piece) comes from the prompt's
    step, the next cannot."""

    def broken(*_a, **_k):
        raise RuntimeError("a device fault")

    svc.engine.decode = broken


def _sse(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_failure_after_the_first_event_ends_the_stream_with_an_error_and_done(tiny_bundle, path):
    with serving(tiny_bundle) as (c, svc):
        _failing_after_the_first_token(svc)
        r = c.post(path, json=_body(path, 20))
        assert r.status_code == 200  # the head was written before the engine failed
        data = _sse(r.text)
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2]).get("error"), data[-3:]
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and error["code"] == 500
        assert "the server's log has the details" in error["message"]
        assert all("error" not in json.loads(d) for d in data[:-2])
        # Counted as the failure it was, not as the 200 its head said.
        assert _metric(c, f'doel_requests_total{{route="{path}",status="500"}}') == 1
        assert _metric(c, f'doel_requests_total{{route="{path}",status="200"}}') == 0
        assert _freed(svc)
        assert c.app.state.models.default.in_flight == 0


def test_the_official_client_reads_each_streams_failure(tiny_bundle):
    openai = pytest.importorskip("openai", reason="the dev extra: pip install 'doel[dev]'")
    with serving(tiny_bundle) as (c, svc):
        _failing_after_the_first_token(svc)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c)
        stream = client.chat.completions.create(
            model=svc.name, messages=CHAT["messages"], max_tokens=20, stream=True
        )
        with pytest.raises(openai.APIError, match="internal error"):
            list(stream)
        # The Responses API's failure is an event of its own, parsed as such.
        events = list(client.responses.create(model=svc.name, input="নদী", stream=True))
        assert events[-1].type == "response.failed"
        assert events[-1].response.status == "failed"
        assert events[-1].response.error.code == "server_error"


def test_a_responses_stream_that_fails_ends_with_response_failed(tiny_bundle):
    with serving(tiny_bundle) as (c, svc):
        _failing_after_the_first_token(svc)
        r = c.post("/v1/responses", json=_body("/v1/responses", 20))
        events = [json.loads(d) for d in _sse(r.text)]
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.failed" and kinds.count("response.failed") == 1
        assert "response.completed" not in kinds and "response.incomplete" not in kinds
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
        assert failed["error"]["code"] == "server_error"
        assert "the server's log has the details" in failed["error"]["message"]
        assert _metric(c, 'doel_requests_total{route="/v1/responses",status="500"}') == 1
        assert _freed(svc)


def _scope(path: str, body: bytes) -> dict:
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json")]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }


class Client:
    """One request's ASGI `receive` and `send`: the body, then `http.disconnect` once `gone`
    is set; each message sent is kept, and the send of body chunk number `stall` (from 1)
    never returns (a client that stops reading), `leave` set first (a client that leaves)."""

    def __init__(self, body: dict, stall: int, leave: bool):
        self.body, self.stall, self.leave = json.dumps(body).encode(), stall, leave
        self.sent: list[dict] = []
        self.gone = asyncio.Event()
        self.read = False

    async def receive(self) -> dict:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        chunks = sum(m["type"] == "http.response.body" for m in self.sent)
        if message["type"] == "http.response.body" and chunks == self.stall:
            if self.leave:
                self.gone.set()
            await asyncio.Event().wait()  # for ever


async def _call(app, path: str, client: Client, within: float) -> tuple[float, int]:
    """The ASGI call of one request, which must end within `within` seconds; its time, and
    how many sequences the scheduler holds that no one has let go of as it returns (read
    before anything else can run on the loop; the engine thread frees an aborted one's slot
    at its next step)."""
    start = time.monotonic()
    with anyio.fail_after(within):
        await app(_scope(path, client.body), client.receive, client.send)
    sched = app.state.service.scheduler
    held = [s for s in (*list(sched.running.values()), *sched.waiting) if not s.cancelled]
    return time.monotonic() - start, len(held)


def _freed(svc: Service, within: float = 5.0) -> bool:
    """The scheduler's slots are all free within `within` seconds."""
    end = time.monotonic() + within
    while svc.scheduler.running and time.monotonic() < end:
        time.sleep(0.02)
    return not svc.scheduler.running


def _slow(svc: Service, seconds: float) -> None:
    """Each decode step takes `seconds` more: the reply is still being made when the test
    looks."""
    decode = svc.engine.decode

    def slow(*a, **k):
        time.sleep(seconds)
        return decode(*a, **k)

    svc.engine.decode = slow


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_that_stops_reading_is_let_go_after_the_write_timeout(tiny_bundle, path):
    with serving(tiny_bundle, write_timeout=0.5) as (c, svc):
        _slow(svc, 0.2)  # 60 tokens: 12 s
        client = Client(_body(path, 60), stall=2, leave=False)
        took, running = c.portal.call(_call, c.app, path, client, 8.0)
        assert took < 6 and running == 0  # the reply is let go of at once
        assert _freed(svc)
        assert c.app.state.models.default.in_flight == 0  # its lease ended
        assert _metric(c, f'doel_requests_total{{route="{path}",status="499"}}') == 1
        assert _metric(c, f'doel_requests_total{{route="{path}",status="200"}}') == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_that_leaves_during_the_first_event_frees_its_slot_at_once(tiny_bundle, path):
    with serving(tiny_bundle) as (c, svc):
        _slow(svc, 0.2)
        client = Client(_body(path, 60), stall=1, leave=True)
        gc.disable()  # the slot must be free when the call returns, not when it is collected
        try:
            took, running = c.portal.call(_call, c.app, path, client, 8.0)
        finally:
            gc.enable()
        assert running == 0 and took < 6
        assert _freed(svc)
        assert c.app.state.models.default.in_flight == 0
        assert _metric(c, f'doel_requests_total{{route="{path}",status="499"}}') == 1
