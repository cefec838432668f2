"""Each client's request bodies at its rate, as the Guard paces them (ratelimit.BodyBudget,
whose arithmetic test_ratelimit.py checks; issue 36, point 3): a large body past the rate waits
its turn unread, one that would wait too long is a 429 with Retry-After in the OpenAI shape,
small bodies never wait, and one client's bodies do not slow another's. The live flood is in
tests/serve/edge/test_shared.py."""

from __future__ import annotations

import asyncio
import time

import httpx2

from doel.serve.edge.guard import Guard


async def _echo(scope, receive, send):
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"%d" % len(body)})


def _post_all(app, bodies: list[tuple[str, bytes]]) -> list[tuple[int, float, httpx2.Response]]:
    """Each (key, body) POSTed at once; status, seconds taken, response."""

    async def one(c, key, body):
        start = time.perf_counter()
        r = await c.post("/v1/chat/completions", content=body, headers={"authorization": key})
        return r.status_code, time.perf_counter() - start, r

    async def run():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://x") as c:
            return await asyncio.gather(*(one(c, k, b) for k, b in bodies))

    return asyncio.run(run())


def test_the_guard_holds_a_large_body_and_refuses_one_that_would_wait_too_long():
    keys = {"key-a": "alice", "key-b": "bob"}
    app = Guard(_echo, max_body_bytes=100_000, keys=keys, body_rate=200_000)
    big = b"x" * 100_000
    a, b = "Bearer key-a", "Bearer key-b"
    # alice: the burst passes one body at once, the next waits half a second; bob: at once.
    answers = _post_all(app, [(a, big), (a, big), (b, big)])
    assert [s for s, _, _ in answers] == [200] * 3
    assert [r.text for _, _, r in answers] == ["100000"] * 3  # the body read whole after
    first, second = sorted(t for _, t, _ in answers[:2])
    assert first < 0.3 and answers[2][1] < 0.3 and 0.4 < second < 2.0, answers
    slow = Guard(_echo, max_body_bytes=100_000, keys=keys, body_rate=5_000)
    ((_, _, ok),) = _post_all(slow, [(a, big)])
    ((status, took, r),) = _post_all(slow, [(a, big)])
    assert ok.status_code == 200 and status == 429 and took < 0.3  # 20 s away: not held
    error = r.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "--client-body-rate" in error["message"]
    assert int(r.headers["retry-after"]) == 10  # 20 s of rate, less the 10 s it may wait
    # --client-body-rate 0: no pacing at all.
    free = Guard(_echo, max_body_bytes=100_000, keys=keys, body_rate=0)
    assert [s for s, _, _ in _post_all(free, [(a, big)] * 4)] == [200] * 4
