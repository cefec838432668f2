"""Serve: requests taking turns on the one engine: a full queue is refused with 429 and
Retry-After, and a stream abandoned mid-way (a client gone) frees the engine at once."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from test_serve_engine import tiny_bundle

from serve.app import Settings, create_app
from serve.protocol import CompletionRequest
from serve.service import RequestError, Service


@pytest.fixture(scope="module")
def svc(tmp_path_factory, tokenizer_path) -> Service:
    return Service.load(str(tiny_bundle(tmp_path_factory, tokenizer_path)), threads=1, max_queue=1)


def test_an_abandoned_stream_releases_the_engine_and_the_next_request_runs(svc):
    async def main():
        stream = svc.complete(CompletionRequest(prompt="নদী", max_tokens=50, temperature=0))
        await anext(stream)
        assert svc.lock.locked()
        await stream.aclose()  # what the server does when the client disconnects
        assert not svc.lock.locked()
        req = CompletionRequest(prompt="নদী", max_tokens=3, temperature=0)
        return [p async for p in svc.complete(req)]

    pieces = asyncio.run(main())
    assert pieces[-1].completion_tokens == 3 and pieces[-1].finish_reason == "length"


def test_a_full_queue_is_refused_and_waiting_requests_run_in_turn(svc):
    async def main():
        await svc.lock.acquire()  # a request in progress
        req = CompletionRequest(prompt="a", max_tokens=2, temperature=0)
        waiting = asyncio.create_task(_collect(svc.complete(req)))
        await asyncio.sleep(0.05)
        assert svc.waiting == 1
        with pytest.raises(RequestError) as refused:
            await anext(svc.complete(req))
        svc.lock.release()
        return refused.value, await waiting

    refused, done = asyncio.run(main())
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}
    assert done[-1].completion_tokens == 2


async def _collect(stream):
    return [p async for p in stream]


def test_429_over_http_carries_retry_after(tmp_path_factory, tokenizer_path):
    bundle = tiny_bundle(tmp_path_factory, tokenizer_path)
    loaded = Service.load(str(bundle), threads=1, max_queue=0)
    app = create_app(Settings(bundle=str(bundle)), loader=lambda _s: loaded)
    with TestClient(app) as c:
        while c.get("/health").status_code != 200:
            pass
        c.portal.call(loaded.lock.acquire)  # the app's own event loop holds the engine
        r = c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "requests are waiting" in r.json()["error"]["message"]
        c.portal.call(loaded.lock.release)
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_closing_the_http_stream_closes_the_service_generator():
    from serve.app import _first

    closed = []

    async def pieces():
        try:
            for i in range(10):
                yield i
        finally:
            closed.append(True)

    async def main():
        wrapped = await _first(pieces())
        assert await anext(wrapped) == 0 and await anext(wrapped) == 1
        await wrapped.aclose()
        assert closed == [True]  # at once, not when the loop shuts its generators down

    asyncio.run(main())
