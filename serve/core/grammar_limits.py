"""What one request's grammar may cost the server, and how a grammar past it is refused.

- `PARSER_LIMITS`: llguidance's parser limits (LLParserLimits), each set here rather than left to
  the engine's defaults, so that the work and memory one request's grammar may take are this
  server's decision; `refusal` turns the engine's error for one into a 400 that names the
  limit and its value (or, for a schema the engine cannot enforce, the keyword).
- `compiled`: a compile on a thread of its own, off the event loop, bounded in time
  (--compile-timeout): past it the request is a 400, and the loop serves the other clients
  throughout. The bound counts the compile's own work only, for the 400 tells the client to
  simplify its schema: the clock starts when the compile starts on its thread (a burst of valid
  schemas queues for the two threads, and that wait is the server's, not the schema's), and
  stops while the compile is `uncounted` (the first-use build of a tokenizer's compilers,
  `Service.grammars`: the server's cost, once). The wait for a thread is bounded on its own:
  QUEUE_BOUNDS times --compile-timeout, then a 503 with Retry-After, the compile taken out of
  the queue unrun (a request that leaves takes its queued compile with it too).

The compiled-format cache's bound in bytes is `structured`'s (CACHE_BYTES); the bounds on what
a request may send (tools, input) are `bounds`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import llguidance

from doel.serve.edge.bounds import limits
from doel.serve.edge.refusal import RequestError

# llguidance's parser limits (LLParserLimits), set here, not left to its defaults, so that what
# one request's grammar may cost is this server's decision. A grammar past one is a 400 naming
# it (`LIMIT_WORDS`), when compiled or at its first mask; past one later, its row ends
# ("length"), the others carry on. The realistic schemas of the tests and the benchmark need a
# small fraction of each (a 400-token walk: under 10,000 step fuel, a few hundred states).
PARSER_LIMITS = {
    # Regex work while compiling (about 50 per µs): a 5,000-property schema fits.
    "initial_lexer_fuel": 1_000_000,
    # Grammar symbols: bounds the size of a compiled grammar, and so its memory.
    "max_grammar_size": 500_000,
    # Regex work for one token's mask (about 14 per µs): about 7 ms at most, which the mask
    # thread hides behind the model's step; llguidance allows twice that.
    "step_lexer_fuel": 100_000,
    # Earley items for one token's mask (about 20 per µs): about 1 ms.
    "step_max_items": 20_000,
    # Lexer states, built as masks are computed and kept with the compiled grammar (1-2 KiB
    # each): 40 MB at most a grammar, where llguidance's 250,000 allows 500 MB.
    "max_lexer_states": 20_000,
    # Items in one row of the parse: a row this wide is a grammar that explodes.
    "max_items_in_row": 2_000,
}
# The words of llguidance's error for each limit (parser/src: grammar_builder.rs, parser.rs,
# regexvec.rs).
LIMIT_WORDS = {
    "initial lexer configuration": "initial_lexer_fuel",
    "limits.initial_lexer_fuel": "initial_lexer_fuel",
    "DNF too large": "initial_lexer_fuel",
    "grammar size (number of symbols)": "max_grammar_size",
    "too many expressions constructed": "step_lexer_fuel",
    "too many states": "max_lexer_states",
    "Too many items": "step_max_items",
    "Current row has": "max_items_in_row",
}
# Compiles run here, off the event loop and apart from the tokenizer's threads: a slow compile
# holds no thread that encodes prompts.
COMPILE_THREAD_COUNT = 2
COMPILE_THREADS = ThreadPoolExecutor(COMPILE_THREAD_COUNT, thread_name_prefix="doel-compile")
# A compile waits for a thread at most this many --compile-timeouts (20 s by default): each
# compile ahead of it takes well under one, so a longer wait is a server swamped with them.
QUEUE_BOUNDS = 4
# The Clock of the compile running on this thread, if any (`uncounted` stops it).
_RUNNING = threading.local()


def parser_limits() -> llguidance.LLParserLimits:
    # Terse errors: a refusal is one line, with no parser state in it.
    return llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)


class Clock:
    """One compile's own time, kept by its thread and read by the request awaiting it: from
    when the thread starts it, less the time spent `uncounted`. The thread writes `_marks` in
    one assignment (start, seconds uncounted, uncounted since or None), so a read is whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.started = loop.create_future()  # set when a thread takes the compile
        self._loop = loop
        self._marks: tuple[float, float, float | None] = (0.0, 0.0, None)

    def run(self, compile_, *args):
        """`compile_(*args)`, on the compile thread, timed."""
        self._marks = (time.perf_counter(), 0.0, None)
        self._loop.call_soon_threadsafe(_settle, self.started)
        _RUNNING.clock = self
        try:
            return compile_(*args)
        finally:
            _RUNNING.clock = None

    def spent(self) -> float:
        start, skipped, since = self._marks
        now = time.perf_counter()
        return now - start - skipped - (0.0 if since is None else now - since)

    def pause(self) -> bool:
        """Stop the clock; False if it was stopped already (an `uncounted` inside another)."""
        start, skipped, since = self._marks
        if since is not None:
            return False
        self._marks = (start, skipped, time.perf_counter())
        return True

    def resume(self) -> None:
        start, skipped, since = self._marks
        self._marks = (start, skipped + time.perf_counter() - since, None)


def _settle(future: asyncio.Future) -> None:
    if not future.done():  # its request may have left
        future.set_result(None)


@contextlib.contextmanager
def uncounted():
    """Work inside is not the compile's own (a tokenizer's compilers built on first use): the
    clock of the compile running on this thread stops meanwhile. Elsewhere, nothing."""
    clock = getattr(_RUNNING, "clock", None)
    if clock is None or not clock.pause():
        yield
        return
    try:
        yield
    finally:
        clock.resume()


async def compiled(param: str, compile_, *args):
    """`compile_(*args)` (a Grammars compiler, or the Service's) on a compile thread, or a 400
    naming `param` once its own work passes --compile-timeout seconds (a 503 when no thread
    takes it within QUEUE_BOUNDS of them): the event loop serves the other clients meanwhile.
    The engine cannot be interrupted: a compile past the bound runs on to its end (its limits
    keep that short) and is cached, but nobody waits for it."""
    seconds = limits().compile_timeout
    loop = asyncio.get_running_loop()
    clock = Clock(loop)
    work = loop.run_in_executor(COMPILE_THREADS, clock.run, compile_, *args)
    try:
        await _started(clock, work, seconds)
        while not work.done():
            left = seconds - clock.spent()
            if left <= 0:
                raise RequestError(
                    400,
                    f"{param} took over {seconds:g} s to compile, this server's limit "
                    "(--compile-timeout); simplify it",
                    param,
                )
            await asyncio.wait({work}, timeout=left)
        return work.result()
    finally:
        work.cancel()  # a compile still queued is not run; one running ends unwatched


async def _started(clock: Clock, work: asyncio.Future, seconds: float) -> None:
    """Returns once a thread has taken the compile; a 503 past QUEUE_BOUNDS x `seconds`."""
    wait = QUEUE_BOUNDS * seconds
    await asyncio.wait({clock.started, work}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    if clock.started.done() or work.done():
        return
    error = RequestError(
        503,
        f"the server's grammar compiler is busy: this request waited {wait:g} s for one of its "
        f"{COMPILE_THREAD_COUNT} compile threads; retry shortly",
        kind="unavailable_error",
    )
    error.headers = {"Retry-After": str(max(1, math.ceil(seconds)))}
    raise error


def limit_of(engine_message: str) -> str | None:
    """The PARSER_LIMITS name an engine error is about, or None."""
    return next((name for w, name in LIMIT_WORDS.items() if w in engine_message), None)


def refusal(engine_message: str, param: str) -> str:
    """The one-line refusal of a grammar the engine will not run: past one of its limits (named,
    with this server's value), or a schema it cannot enforce; the engine's own words name the
    keyword (`Unimplemented keys: ["not"]`, `Unknown format: ...`, a regex feature)."""
    why = " ".join(engine_message.split())[:300]
    limit = limit_of(engine_message)
    if limit is not None:
        return (
            f"{param} is past this server's grammar limit {limit} ({PARSER_LIMITS[limit]:,}): "
            f"{why}; simplify it (fewer alternatives, shorter patterns, less nesting)"
        )
    return (
        f"{param} cannot be enforced by this server's grammar engine (llguidance): {why}; "
        "remove or rewrite that part of the schema"
    )
