"""--compile-timeout bounds a compile's own work (serve/core/grammar_limits.py `compiled`): the
clock
starts when the compile starts on its thread, so a burst of valid schemas that queue for the two
compile threads all compile, a compile past the bound is still a 400, the first-use build of the
tokenizer's compilers (`Service.grammars`) is not counted, and a wait for a thread is bounded on
its own (503 with Retry-After). The compiles are planted (sleeps), so each test takes about a
second."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core import grammar_limits
from doel.serve.core.structured import Grammars
from doel.serve.edge.app import create_app
from doel.serve.edge.bounds import LIMITS
from doel.serve.edge.refusal import RequestError
from doel.serve.settings import Settings

BOUND = 0.5  # --compile-timeout of these tests
THREADS = grammar_limits.COMPILE_THREAD_COUNT


def sleeper(seconds: float, ran: list | None = None):
    def compile_():
        if ran is not None:
            ran.append(time.perf_counter())
        time.sleep(seconds)
        return "compiled"

    return compile_


def bounded(coro_fn, bound: float = BOUND):
    """Run `coro_fn()` with --compile-timeout `bound` as the request's limit."""

    async def main():
        token = LIMITS.set(Settings(bundle="none", compile_timeout=bound))
        try:
            return await coro_fn()
        finally:
            LIMITS.reset(token)

    return asyncio.run(main())


def occupy(seconds: float) -> list:
    """Every compile thread busy for `seconds` (futures to wait on before the test ends)."""
    return [grammar_limits.COMPILE_THREADS.submit(time.sleep, seconds) for _ in range(THREADS)]


def test_a_burst_of_compiles_each_under_the_bound_all_succeed():
    """Eight compiles of 0.3 s at once on two threads: the last ones wait 0.9 s for a thread,
    which is not theirs to count (each was a 400 when the wait counted)."""
    n = 4 * THREADS

    async def burst():
        work = [grammar_limits.compiled("response_format", sleeper(0.3)) for _ in range(n)]
        return await asyncio.gather(*work, return_exceptions=True)

    t0 = time.perf_counter()
    got = bounded(burst)
    assert got == ["compiled"] * n, [getattr(g, "message", g) for g in got]
    assert time.perf_counter() - t0 >= 0.3 * n / THREADS  # they did queue


def test_a_compile_past_the_bound_is_a_400_counted_from_its_start_on_a_thread():
    """A 1.5 s compile queued behind 0.4 s of other work is refused 0.5 s after it starts, about
    0.9 s after it was asked for: its wait is not counted, its own work is."""
    ran = []

    async def slow():
        busy = occupy(0.4)
        t0 = time.perf_counter()
        try:
            with pytest.raises(RequestError) as e:
                await grammar_limits.compiled("tools[0].function.parameters", sleeper(1.5, ran))
            return e.value, t0, time.perf_counter()
        finally:
            await asyncio.wrap_future(busy[-1])

    error, asked, refused = bounded(slow)
    assert error.status == 400 and error.param == "tools[0].function.parameters"
    assert "took over 0.5 s" in error.message and "--compile-timeout" in error.message
    assert ran[0] - asked >= 0.35  # it did wait for a thread
    assert BOUND <= refused - ran[0] < BOUND + 0.4  # refused at the bound from its start
    time.sleep(1.2)  # let the abandoned compile end before the next test


def test_the_uncounted_part_of_a_compile_is_not_counted():
    """`uncounted()` (the first-use build of the tokenizer's compilers) stops the clock: 0.6 s
    in it plus 0.3 s of compiling is within a 0.5 s bound; 0.6 s of compiling is not."""

    def with_a_build():
        with grammar_limits.uncounted():
            time.sleep(0.6)
        time.sleep(0.3)
        return "compiled"

    assert bounded(lambda: grammar_limits.compiled("response_format", with_a_build)) == "compiled"
    with pytest.raises(RequestError, match="took over"):
        bounded(lambda: grammar_limits.compiled("response_format", sleeper(0.6)))
    time.sleep(0.2)


def test_a_wait_for_a_compile_thread_is_bounded_on_its_own():
    """Both threads held past QUEUE_BOUNDS x --compile-timeout: a compile that cannot start is a
    503 with Retry-After saying the compiler is busy (not a 400 telling the client to simplify
    a schema that is fine), and it never runs."""
    ran, bound = [], 0.1
    wait = grammar_limits.QUEUE_BOUNDS * bound

    async def queued():
        busy = occupy(wait + 0.3)
        t0 = time.perf_counter()
        try:
            with pytest.raises(RequestError) as e:
                await grammar_limits.compiled("response_format", sleeper(0, ran))
            return e.value, time.perf_counter() - t0
        finally:
            await asyncio.wrap_future(busy[-1])

    error, waited = bounded(queued, bound)
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert "busy" in error.message and "retry" in error.message and "\n" not in error.message
    assert wait <= waited < wait + 0.25
    time.sleep(0.1)
    assert ran == []  # taken out of the queue, not run after its request was answered


def test_a_request_that_leaves_while_queued_takes_its_compile_with_it():
    ran = []

    async def leave():
        busy = occupy(0.3)
        task = asyncio.create_task(grammar_limits.compiled("response_format", sleeper(0, ran)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wrap_future(busy[-1])
        await asyncio.sleep(0.1)

    bounded(leave)
    assert ran == []


def test_the_first_use_build_of_the_tokenizers_compilers_is_not_counted(tiny_bundle, monkeypatch):
    """Building `svc.grammars` (planted: 0.8 s, as a large vocabulary takes) on a structured
    request's compile thread is not the schema's compile time: two first requests at once, one
    building and one waiting for it, both compile (each was a 400 when the build counted)."""
    from tokenizers import Tokenizer

    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.service import Service

    build, builds = Grammars.__init__, []

    def slow_build(self, *args, **kw):
        builds.append(self)
        time.sleep(0.8)
        build(self, *args, **kw)

    monkeypatch.setattr(Grammars, "__init__", slow_build)
    bundle = read_bundle(tiny_bundle)
    svc = Service(Engine(bundle, threads=1), Tokenizer.from_file(str(bundle.tokenizer)), "m")
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer"}}}

    async def first_two():
        both = [grammar_limits.compiled("response_format", svc.compile_format, rf) for _ in "ab"]
        return await asyncio.gather(*both)

    one, two = bounded(first_two)
    assert one.kind == two.kind == "json_schema"
    assert one.grammars is two.grammars is svc.grammars and len(builds) == 1


def test_a_burst_of_structured_requests_through_the_app_all_answer(tiny_bundle, monkeypatch):
    """Eight /v1/completions with a schema at once, each compile planted at 0.3 s (under the
    0.5 s bound): all 200, none a 400 for time spent waiting behind the others' compiles."""
    compile_ = Grammars.json_schema

    def slow(self, schema, param="response_format"):
        time.sleep(0.3)
        return compile_(self, schema, param)

    monkeypatch.setattr(Grammars, "json_schema", slow)
    settings = Settings(bundle=str(tiny_bundle), threads=1, compile_timeout=BOUND)
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer"}}}
    body = {"prompt": "x", "max_tokens": 2, "response_format": rf}
    with TestClient(create_app(settings)) as c:
        ready(c)
        start = threading.Barrier(8)

        def post(_):
            start.wait()
            return c.post("/v1/completions", json=body)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
