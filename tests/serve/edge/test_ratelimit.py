"""Each client's rate of requests (ratelimit.RequestRate, asked by the Guard): the buckets'
arithmetic on a fake clock (BodyBudget's, of body bytes, too); a client over its rate gets a 429
in the OpenAI shape with Retry-After, before its body is read, while another client (tenant or
address) is still served; probes count apart; 0 turns it off. Live: clients looping /health and
tiny bad requests back to back leave another client's chat within twice its idle latency."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time

import httpx2
import pytest
from live_server import live_server

from doel.serve.edge.guard import Guard
from doel.serve.edge.ratelimit import (
    BURST_SECONDS,
    PROBE_FACTOR,
    SMALL_BODY,
    BodyBudget,
    ClientRates,
    RequestRate,
)
from doel.serve.settings import Settings

DEFAULT_REQUEST_RATE = Settings.client_request_rate


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_passes_its_burst_then_its_rate_and_says_when_to_retry():
    clock = Clock()
    rate = RequestRate(rate=4, burst=8, clock=clock)
    assert [rate.take("a") for _ in range(8)] == [0] * 8  # the burst
    assert rate.take("a") == 1  # a quarter second away: Retry-After is whole seconds, >= 1
    assert rate.take("b") == 0  # another client has its own bucket
    clock.now += 0.5  # two requests' worth
    assert [rate.take("a") for _ in range(3)] == [0, 0, 1]
    clock.now += 60.0  # refilled to the burst, no further
    assert [rate.take("a") for _ in range(9)] == [0] * 8 + [1]
    slow = RequestRate(rate=0.1, burst=1, clock=clock)  # one every 10 s
    assert slow.take("a") == 0 and slow.take("a") == 10
    clock.now += 4.0
    assert slow.take("a") == 6  # a refusal takes nothing: the wait only shortens
    assert RequestRate(rate=50).burst == 50 * BURST_SECONDS
    with pytest.raises(ValueError):
        RequestRate(rate=0)


def test_clients_gone_quiet_are_forgotten():
    clock = Clock()
    rate = RequestRate(rate=10, burst=10, clock=clock)
    for i in range(5000):
        rate.take(i)
    clock.now += 1.0  # the first 5,000 are full again
    for i in range(5000, 10_000):
        rate.take(i)
    assert len(rate.buckets) <= 5000 and 9999 in rate.buckets


def test_bodies_past_the_rate_wait_their_turn_and_small_ones_never_wait():
    clock = Clock()
    budget = BodyBudget(rate=100_000, burst=200_000, max_wait=1.0, clock=clock)
    big = 100_000
    assert budget.charge("a", big) == 0 and budget.charge("a", big) == 0  # the burst
    assert budget.charge("a", big) == pytest.approx(1.0)  # one second of rate behind it
    assert budget.charge("a", big) is None  # two seconds: over max_wait, nothing charged
    assert budget.retry_after("a", big) == 1
    assert budget.charge("a", SMALL_BODY) == 0  # a chat is not held behind large bodies
    assert budget.charge("b", big) == 0  # another client has its own budget
    clock.now += 2.0  # the rate refills what was charged
    assert budget.charge("a", big) == pytest.approx(SMALL_BODY / 100_000)
    clock.now += 60.0
    assert budget.charge("a", big) == 0  # refilled to the burst, no further
    assert budget.charge("a", big) == 0 and budget.charge("a", big) > 0


def test_bodies_of_clients_gone_quiet_are_forgotten():
    clock = Clock()
    budget = BodyBudget(rate=1000, burst=1000, clock=clock)
    for i in range(5000):
        budget.charge(i, 10)
    clock.now += 1.0  # the first 5,000 are full again
    for i in range(5000, 10_000):
        budget.charge(i, 10)
    assert len(budget.buckets) <= 5000 and 9999 in budget.buckets


def test_probes_count_apart_at_ten_times_the_rate():
    rates = ClientRates(rate=2, clock=Clock())
    assert rates.of("/health") is rates.of("/metrics") is not rates.of("/v1/models")
    assert rates.of("/health").rate == PROBE_FACTOR * 2 == rates.of("/health").burst
    assert rates.of("/v1/models").burst == 2 * BURST_SECONDS
    assert [rates.of("/health").take("a") for _ in range(21)] == [0] * 20 + [1]
    assert rates.of("/v1/models").take("a") == 0  # the API bucket is untouched


class Echo:
    """An app that counts the requests it was reached by and the bodies it read."""

    def __init__(self):
        self.reached = 0

    async def __call__(self, scope, receive, send):
        self.reached += 1
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _send(app, requests: list[tuple[str, str, str, str | None]]) -> list[httpx2.Response]:
    """Each (address, method, path, key) in turn, from that address."""

    async def run():
        answers = []
        for address, method, path, key in requests:
            transport = httpx2.ASGITransport(app=app, client=(address, 1234))
            async with httpx2.AsyncClient(transport=transport, base_url="http://x") as c:
                head = {"authorization": f"Bearer {key}"} if key else {}
                content = b'{"messages": []}' if method == "POST" else None
                answers.append(await c.request(method, path, headers=head, content=content))
        return answers

    return asyncio.run(run())


def _statuses(answers) -> list[int]:
    return [r.status_code for r in answers]


def test_a_tenant_over_its_rate_is_refused_before_its_body_and_another_is_served():
    keys = {"key-a": "alice", "key-b": "bob"}
    echo = Echo()
    app = Guard(echo, keys=keys, request_rate=1)  # a burst of 10, then one a second
    post = ("10.0.0.1", "POST", "/v1/chat/completions")
    answers = _send(app, [(*post, "key-a")] * 12)
    assert _statuses(answers) == [200] * 10 + [429] * 2
    assert echo.reached == 10  # the refused were neither read nor routed
    r = answers[-1]
    error = r.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "--client-request-rate" in error["message"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert r.headers["content-type"] == "application/json" and int(r.headers["retry-after"]) == 1
    # bob, from the same address, and alice's probes are still served.
    assert _statuses(_send(app, [(*post, "key-b")] * 5)) == [200] * 5
    assert _statuses(_send(app, [("10.0.0.1", "GET", "/health", None)] * 3)) == [200] * 3
    # A wrong key counts for its address: refused 401 within the rate, then 429.
    wrong = _send(app, [("10.0.0.9", "GET", "/v1/models", "nope")] * 11)
    assert _statuses(wrong) == [401] * 10 + [429]


def test_without_keys_each_address_has_its_own_rate_and_0_turns_it_off():
    app = Guard(Echo(), request_rate=2)  # a burst of 20
    flood = _send(app, [("10.0.0.1", "GET", "/v1/models", None)] * 25)
    assert _statuses(flood) == [200] * 20 + [429] * 5
    assert _statuses(_send(app, [("10.0.0.2", "GET", "/v1/models", None)] * 5)) == [200] * 5
    free = Guard(Echo(), request_rate=0)
    assert _statuses(_send(free, [("10.0.0.1", "GET", "/v1/models", None)] * 600)) == [200] * 600
    assert Guard(Echo()).requests.api.rate == DEFAULT_REQUEST_RATE


# Live: clients sending tiny requests back to back (probes, bad JSON, a wrong key), each thread
# a new connection on each refusal's close or kept alive, as it comes.
FLOOD = """
import http.client, json, sys, threading, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kinds = [("GET", "/health", None, {}),
         ("POST", "/v1/chat/completions", b"{", {"authorization": "Bearer attacker-key"}),
         ("GET", "/v1/models", None, {"authorization": "Bearer wrong"})]
on, lock, answered, statuses, sending = threading.Event(), threading.Lock(), [0], set(), [0]
def loop(i):  # back to back while on: the next request as soon as the last is answered
    c = http.client.HTTPConnection(host, port, timeout=30)
    method, path, body, head = kinds[i % len(kinds)]
    while on.wait():
        with lock: sending[0] += 1
        c.request(method, path, body, head)
        r = c.getresponse(); r.read()
        with lock: answered[0] += 1; statuses.add(r.status); sending[0] -= 1
for i in range(n): threading.Thread(target=loop, args=(i,), daemon=True).start()
for line in sys.stdin:  # "on" / "off", acknowledged once none is still being answered
    on.set() if line.strip() == "on" else on.clear()
    while not on.is_set() and sending[0]:
        time.sleep(0.005)
    print(json.dumps({"answered": answered[0], "statuses": sorted(statuses)}), flush=True)
"""
FLOODERS = 6  # two threads of each kind
ROUNDS, TRIALS = 4, 40  # idle and flooded chats take turns, ROUNDS times, TRIALS of each
KEY_FILE = "victim:victim-key\nattacker:attacker-key\nimpatient:impatient-key\n"


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    """doel-serve at the default request rate, with three tenants."""
    folder = tmp_path_factory.mktemp("rate")
    (folder / "keys").write_text(KEY_FILE)
    with live_server(tiny_bundle, folder, "--api-key-file", str(folder / "keys")) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def _chat_times(client, n: int) -> list[float]:
    times, head = [], {"authorization": "Bearer victim-key"}
    body = {"messages": [{"role": "user", "content": "নমস্কার"}], "max_tokens": 16, "seed": 1}
    for _ in range(n):
        start = time.perf_counter()
        r = client.post("/v1/chat/completions", json=body, headers=head)
        times.append(time.perf_counter() - start)
        assert r.status_code == 200, r.text
    return times


def _toggle(flood, word: str) -> dict:
    flood.stdin.write(f"{word}\n")
    flood.stdin.flush()
    return json.loads(flood.stdout.readline())


def test_a_flood_of_small_requests_leaves_another_chat_within_twice_idle(server):
    with httpx2.Client(base_url=server.url, trust_env=False, timeout=30) as c:
        _chat_times(c, 5)  # warm
        host, port = server.url.removeprefix("http://").split(":")
        command = [sys.executable, "-c", FLOOD, host, port, str(FLOODERS)]
        idle, busy, pipes = [], [], {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        with subprocess.Popen(command, text=True, **pipes) as flood:
            try:
                _toggle(flood, "on")
                time.sleep(1.0)  # past their bursts (500 each): ~2,000 requests a second here
                _toggle(flood, "off")
                for _ in range(ROUNDS):
                    idle += _chat_times(c, TRIALS // ROUNDS)
                    before = _toggle(flood, "on")["answered"]
                    time.sleep(0.3)  # the flood is under way
                    busy += _chat_times(c, TRIALS // ROUNDS)
                    state = _toggle(flood, "off")
                    assert state["answered"] > before, state  # it ran meanwhile
            finally:
                flood.kill()
    idle_ms, busy_ms = statistics.median(idle) * 1e3, statistics.median(busy) * 1e3
    shown = f"idle {idle_ms:.1f} ms, flooded {busy_ms:.1f} ms, {state['answered']} flood answers"
    print(shown)
    assert 429 in state["statuses"], state
    assert statistics.median(busy) <= 2 * statistics.median(idle), shown


def test_a_refused_connection_reads_nothing_until_its_retry_after(server):
    """The 429 comes at once; the next request on that connection is read only after its
    Retry-After, while another tenant is answered meanwhile."""
    impatient = {"authorization": "Bearer impatient-key"}
    victim = {"authorization": "Bearer victim-key"}
    with (
        httpx2.Client(base_url=server.url, trust_env=False, timeout=30, headers=impatient) as a,
        httpx2.Client(base_url=server.url, trust_env=False, timeout=30, headers=victim) as b,
    ):
        for _ in range(int(BURST_SECONDS * DEFAULT_REQUEST_RATE) + 50):  # its burst, and more
            start = time.perf_counter()
            r = a.get("/v1/models")
            if r.status_code == 429:
                break
        took = time.perf_counter() - start
        assert r.status_code == 429 and took < 0.5, (r.status_code, took)
        after = int(r.headers["retry-after"])
        start = time.perf_counter()
        assert b.get("/v1/models").status_code == 200  # another tenant, at once
        assert time.perf_counter() - start < 0.5
        r = a.get("/v1/models")  # the same connection: read once the Retry-After has passed
        assert r.status_code == 200 and time.perf_counter() - start > 0.9 * after


def test_a_negative_rate_is_refused_in_one_line_naming_the_flag(tmp_path):
    from doel.serve.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--client-request-rate", "-1"])
    assert str(e.value) == "error: --client-request-rate must be 0 or more"
