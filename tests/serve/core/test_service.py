"""Serve: concurrent requests share batched decode steps and get the tokens they would get
alone; a full queue is refused with 429 and Retry-After; a stream abandoned mid-way (a client
gone) frees its slot."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core.sampling import SamplingParams
from doel.serve.core.service import Piece, RequestError, Service
from doel.serve.edge.answer import EventStream, first_piece
from doel.serve.edge.app import Settings, create_app
from doel.serve.endpoints.chat import route as chat
from doel.serve.endpoints.chat.protocol import ChatCompletionRequest
from doel.serve.endpoints.completions import route as completions
from doel.serve.endpoints.protocol import CompletionRequest


def _req(**kw) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "নদী", "temperature": 0, **kw})


async def _collect(stream) -> list:
    return [p async for p in stream]


def _text(pieces) -> str:
    return "".join(p.text for p in pieces)


def test_concurrent_requests_share_batched_steps_and_get_what_they_get_alone(tiny_bundle):
    svc = Service.load(str(tiny_bundle), threads=1, slots=4)
    reqs = [_req(prompt=p, max_tokens=n, seed=i, temperature=1.0) for i, (p, n) in
            enumerate([("নদী", 30), ("The river", 12), ("আমাদের গ্রামের নাম", 25), ("a", 20),
                       ("ছোট", 18)])]  # fmt: skip
    alone = [asyncio.run(_collect(svc.complete(r))) for r in reqs]
    batch_sizes = []
    decode = svc.engine.decode
    svc.engine.decode = lambda tokens, totals, lo=0: (
        batch_sizes.append(len(tokens)) or decode(tokens, totals, lo)
    )

    async def together():
        return await asyncio.gather(*(_collect(svc.complete(r)) for r in reqs))

    for a, b in zip(alone, asyncio.run(together())):
        assert _text(a) == _text(b) and a[-1] == b[-1]
    assert max(batch_sizes) == 4  # five requests, four slots: the fifth took a freed slot


def test_an_abandoned_stream_frees_its_slot_and_the_next_request_runs(tiny_bundle):
    svc = Service.load(str(tiny_bundle), threads=1, slots=1)

    async def main():
        stream = svc.complete(_req(max_tokens=80))
        await anext(stream)
        await stream.aclose()  # what the server does when the client disconnects
        nxt = await _collect(svc.complete(_req(max_tokens=3)))
        return nxt, len(svc.scheduler.running)

    pieces, running = asyncio.run(main())
    assert pieces[-1].completion_tokens == 3 and pieces[-1].finish_reason == "length"
    assert running == 0


def _blocked(svc: Service) -> threading.Event:
    """Make the engine's batched step wait for the returned event (a request in progress)."""
    go, decode = threading.Event(), svc.engine.decode

    def slow(tokens, totals, lo=0):
        go.wait(10)
        return decode(tokens, totals, lo)

    svc.engine.decode = slow
    return go


def test_a_full_queue_is_refused_and_waiting_requests_run_in_turn(tiny_bundle):
    svc = Service.load(str(tiny_bundle), threads=1, slots=1, max_queue=1)
    go = _blocked(svc)

    async def main():
        first = asyncio.create_task(_collect(svc.complete(_req(max_tokens=3))))
        second = asyncio.create_task(_collect(svc.complete(_req(max_tokens=2))))
        while len(svc.scheduler.waiting) < 1 or not svc.scheduler.running:
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as refused:
            await anext(svc.complete(_req()))
        go.set()
        return refused.value, await first, await second

    refused, first, second = asyncio.run(main())
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}
    assert first[-1].completion_tokens == 3 and second[-1].completion_tokens == 2


def test_429_over_http_carries_retry_after(tiny_bundle):
    loaded = Service.load(str(tiny_bundle), threads=1, slots=1, max_queue=0)
    go = _blocked(loaded)
    app = create_app(Settings(bundle=str(tiny_bundle)), loader=lambda _s: loaded)
    with TestClient(app) as c:
        ready(c)
        stream = c.portal.call(_started, loaded)  # runs on the app's own event loop
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "requests are waiting" in r.json()["error"]["message"]
        metrics = c.get("/metrics").text
        assert "doel_requests_running 1" in metrics
        go.set()
        c.portal.call(stream.aclose)
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


async def _started(svc: Service):
    # Token ids, not text: the prefill's first id arrives without a decode step (text might
    # wait for the next id, which the blocked step holds back).
    stream = svc.scheduler.generate([0, 5, 6], SamplingParams(max_tokens=50))
    await anext(stream)
    return stream


def test_closing_the_http_stream_closes_the_service_generator():
    closed = []

    async def pieces():
        try:
            for i in range(10):
                yield i
        finally:
            closed.append(True)

    async def main():
        wrapped = await first_piece(pieces())
        assert await anext(wrapped) == 0 and await anext(wrapped) == 1
        await wrapped.aclose()
        assert closed == [True]  # at once, not when the loop shuts its generators down

    asyncio.run(main())


def test_a_long_prompt_is_fed_a_chunk_a_step_between_the_running_streams_tokens(tiny_bundle):
    """Fairness: a prompt arriving while another stream decodes goes in one chunk per step, each
    step also giving the running stream its next token; the batched step covers only the
    decoding slots (the filling slot 0, below the running slot 1, takes no row), and nobody's
    tokens change."""
    svc = Service.load(str(tiny_bundle), threads=1, slots=2)
    engine = svc.engine
    engine.prefill_chunk = 4
    rng = np.random.default_rng(0)
    short, long = [0, 5, 6], rng.integers(8, 2048, size=30).tolist()
    params = {"a": SamplingParams(max_tokens=25, seed=1), "b": SamplingParams(max_tokens=6, seed=2)}
    alone = {
        "a": list(engine.generate(short, params["a"])),
        "b": list(engine.generate(long, params["b"])),
    }
    calls = []
    forward, decode = engine.forward, engine.decode
    engine.forward = lambda ids, past, slot=0, every=False: (
        calls.append(("f", len(ids))) or forward(ids, past, slot, every)
    )
    engine.decode = lambda tokens, totals, lo=0: (
        calls.append(("d", len(tokens))) or decode(tokens, totals, lo)
    )

    async def main():
        sched = svc.scheduler
        # x takes slot 0 and ends at its first id; a takes slot 1; b then gets slot 0.
        x = asyncio.create_task(_collect(sched.generate([0, 7], SamplingParams(max_tokens=1))))
        await asyncio.sleep(0)  # x's generator runs to its queue: it is admitted first
        a_stream = sched.generate(short, params["a"])
        a = [await anext(a_stream)]
        await x
        b = asyncio.create_task(_collect(sched.generate(long, params["b"])))
        a += await _collect(a_stream)
        return a, await b

    a, b = asyncio.run(main())
    assert a == alone["a"] and b == alone["b"]
    feeds = [i for i, c in enumerate(calls) if c[0] == "f"]
    b_feeds = feeds[2:]  # x's prompt, a's prompt, then b's in chunks of at most 4
    assert [calls[i][1] for i in b_feeds] == [4] * 7 + [2]
    # Between two of b's chunks, a decoding step of a's slot alone (b's slot 0 is not in it).
    assert all(calls[i + 1] == ("d", 1) for i in b_feeds[:-1]), calls


def _pieces(closed: list):
    async def pieces():
        try:
            yield Piece("নদী")
            yield Piece("র", "stop", prompt_tokens=3, completion_tokens=2, cached_tokens=1)
        finally:
            closed.append(True)

    return pieces()


def _events(stream) -> list:
    async def main():
        return [e async for e in stream]

    sent = asyncio.run(main())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in sent)
    assert sent[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in sent[:-1]]


@pytest.mark.parametrize("route", [completions, chat])
def test_a_stream_is_its_envelope_on_each_chunk_then_the_usage_then_done(route):
    """Both routes' streams share one skeleton: the same id, object, created and model on
    every chunk, first in each; the text in order; with include_usage one chunk more, with the
    usage and no choices; the pieces closed at the end."""
    svc, closed = SimpleNamespace(name="doel-m"), []
    usage = {"stream_options": {"include_usage": True}, "stream": True}
    if route is chat:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **usage)
    else:
        req = _req(**usage)
    chunks = _events(route.stream(svc, req, _pieces(closed)))
    heads = {tuple(c.items())[:4] for c in chunks}
    assert len(heads) == 1 and [k for k, _ in next(iter(heads))] == [
        "id",
        "object",
        "created",
        "model",
    ]
    head = dict(next(iter(heads)))
    kind = "chat.completion.chunk" if route is chat else "text_completion"
    assert head["object"] == kind and head["model"] == svc.name
    assert head["id"].startswith("chatcmpl-" if route is chat else "cmpl-")
    *answer, last = chunks
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    if route is chat:
        assert answer[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        texts = [c["choices"][0]["delta"].get("content", "") for c in answer]
        assert all(c["usage"] is None for c in answer)  # as OpenAI, with include_usage
    else:
        texts = [c["choices"][0]["text"] for c in answer]
        assert answer[-1]["usage"] == last["usage"]  # the last piece's chunk carries it too
    assert "".join(texts) == "নদীর" and answer[-1]["choices"][0]["finish_reason"] == "stop"
    assert closed == [True]


@pytest.mark.parametrize("route", [completions, chat])
def test_a_stream_whose_client_leaves_after_its_first_event_closes_the_service_generator(route):
    closed = []
    if route is chat:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    else:
        req = _req(stream=True)

    async def endless():  # a reply that ends only when closed
        try:
            while True:
                yield Piece("নদী")
                await asyncio.sleep(0.01)
        finally:
            closed.append(True)

    async def main():
        pieces = await first_piece(endless())  # as serve/edge/answer.py hands them over
        response = EventStream(route.stream(SimpleNamespace(name="m"), req, pieces), pieces, 5)
        sent, gone = [], asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message.get("body"):
                gone.set()  # the client leaves once the first event is written

        await response({"type": "http"}, receive, send)
        return sent, list(closed)  # before asyncio.run's shutdown closes what is left

    sent, closed_by_then = asyncio.run(main())
    assert closed_by_then == [True] and any(m.get("body") for m in sent)
