"""Connection limits, at the HTTP protocol level where the app cannot see: a deadline for reading
each request, a cap on open connections, the open-file limit, and refusals logged one line per
kind instead of a traceback per socket.

uvicorn's h11 protocol (0.54) arms no timer until a first response is complete, so a connection
that sends nothing, half a request, or less body than it announced stays open for ever; and its
`limit_concurrency` answers a plain-text 503 only once a whole request has arrived, so idle
connections over the limit still hold a file descriptor each. `protocol_class` returns a subclass
that adds, per connection:
- one read deadline per request, from the connection's opening (or the first byte after a
  keep-alive pause) to the body's last byte; past it, a 408 in the OpenAI error shape, then close;
- over `max_connections` open, a 503 to its request, and only `BUSY_GRACE` to send it;
- after a 429 for the client's request rate (serve/ratelimit.py), nothing more read from the
  connection until its Retry-After (closed instead past half of `max_connections`);
- the 400 for a request that is not HTTP, or whose head is over 16 KiB, in the error shape. h11
  refuses a head over 16 KiB only while it is incomplete: one sent whole in a single write (20-70
  KB were accepted) is measured here before h11 parses it.

`BodyBudget` paces each client's request bodies (the Guard asks it; a client is its tenant, or
its address without keys). FastAPI parses a JSON body on the event loop that serves every client
(1.2 ms for a 146 KB one here), so four clients sending such bodies back to back (~100 a second)
took the whole loop, and another client's 16 ms chat took 1,066 ms. Parsing in a thread would
shorten the loop's lag behind four parsers (57 ms → 4-8 ms in a probe) but not the CPU and the
GIL they take from the decoding thread. So a client's bodies go through at --client-body-rate
bytes a second (a burst of one largest body): a body past it waits, unread, until the client's
rate allows it, and one that would wait over MAX_BODY_WAIT is refused with 429 and Retry-After.
Bodies up to SMALL_BODY never wait (they cost no parsing to speak of), so a client's chats are
not held behind its own large bodies, nor, without keys, everyone's behind one address's.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter

from doel.contracts.errors import error_body
from doel.serve.ratelimit import HOLD, Buckets

log = logging.getLogger("doel.serve")

# Messages in one chat request (--max-messages): a long conversation has a few hundred turns,
# and each costs validation and rendering (serve/protocol_chat.py refuses more by count).
DEFAULT_MAX_MESSAGES = 512
BUSY_GRACE = 1.0  # seconds a connection over the limit has to send the request its 503 answers
LOG_EVERY = 60.0  # seconds between two log lines of one kind of refusal

DEFAULT_BODY_RATE = 1 << 20  # bytes of request bodies a client may send a second (0: no limit)
SMALL_BODY = 16 * 1024  # bytes of a body that never waits: a chat's, parsed in ~0.1 ms
MAX_BODY_WAIT = 10.0  # seconds a body may wait for its client's rate; longer: 429
MAX_HEAD = 16 * 1024  # bytes of a request's line and headers, its blank line included
HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a head (it accepts bare LF lines too)
REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


class Refusals:
    """Counts refusals by kind (into `metrics.refused`) and logs at most one line per kind a
    minute, saying how many were not logged since: a flood writes a few lines, not one a socket
    (asyncio logs a whole traceback for each refused socket, so a flood over the open-file limit
    would fill the log faster than anyone can read it)."""

    def __init__(self, metrics=None, every: float = LOG_EVERY, clock=time.monotonic):
        self.metrics, self.every, self.clock = metrics, every, clock
        self.last: dict[str, float] = {}
        self.unlogged: Counter[str] = Counter()

    def __call__(self, kind: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.refused[kind] += 1
        now = self.clock()
        if kind in self.last and now - self.last[kind] < self.every:
            self.unlogged[kind] += 1
            return
        self.last[kind] = now
        more = self.unlogged.pop(kind, 0)
        log.warning("%s%s", message, f" ({more} more since the last such line)" if more else "")


class QuietFloods(logging.Filter):
    """For the asyncio and uvicorn.error loggers: messages that repeat once per socket become
    `Refusals` lines (asyncio logs a traceback for each failed accept, up to 2,048 a second)."""

    KINDS = {
        "socket.accept() out of system resource": "out_of_files",
        "Invalid HTTP request received.": "bad_http",  # our send_400_response logs it
        "Unsupported upgrade request.": "upgrade",
        "No supported WebSocket library detected": "upgrade",
    }

    def __init__(self, refusals: Refusals):
        super().__init__()
        self.refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        kind = next((k for m, k in self.KINDS.items() if text.startswith(m)), None)
        if kind == "out_of_files":
            exc = record.exc_info[1] if record.exc_info else None
            self.refusals(
                kind,
                f"cannot accept connections: {exc or 'out of open files'}; raise the open-file "
                "limit (ulimit -n) or lower --max-connections",
            )
        elif kind == "upgrade":
            self.refusals(kind, "refused WebSocket upgrades: this server speaks plain HTTP")
        return kind is None


class BodyBudget(Buckets):
    """A token bucket of body bytes per client: `rate` a second, up to `burst` saved. A body
    is charged at once (the bucket may go below zero: the bodies behind it wait their turn).
    `charge` returns the seconds to wait before the body is read, or None when that would be
    over `max_wait` (nothing charged: the caller refuses it)."""

    def __init__(self, rate: float, burst: int, max_wait: float = MAX_BODY_WAIT, clock=None):
        super().__init__(rate, burst, clock)
        self.max_wait = max_wait

    def charge(self, client, size: int) -> float | None:
        now = self.clock()
        saved = self.level(client, now)
        wait = 0.0 if size <= SMALL_BODY else max(0.0, (size - saved) / self.rate)
        if wait > self.max_wait:
            return None
        self.keep(client, saved - size, now)
        return wait

    def retry_after(self, client, size: int) -> int:
        """Whole seconds until `size` bytes would pass without waiting over max_wait."""
        saved = self.level(client, self.clock())
        return max(1, math.ceil((size - saved) / self.rate - self.max_wait))


def raise_open_files(resource=None) -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (each connection holds a descriptor, and
    1,024 is a common soft default); returns (before, after). No-op where there is no limit."""
    if resource is None:
        try:
            import resource
        except ImportError:  # Windows
            return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):  # e.g. macOS caps below the hard limit
        return soft, soft
    return soft, want


def _raw(status: int, message: str, kind: str) -> bytes:
    """A whole response written past h11: it may have no request to answer yet."""
    body = error_body(status, message, kind)
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _head_too_big(buffered: bytes) -> bool:
    """Whether the head at the start of `buffered` (all of it, or its start) is over MAX_HEAD.
    A buffer within the limit holds no head over it, and is not searched."""
    if len(buffered) <= MAX_HEAD:
        return False
    start = len(buffered) - len(buffered.lstrip(b"\r\n"))  # h11 skips blank lines before one
    end = HEAD_END.search(buffered, start, start + MAX_HEAD + 2)
    return end is None or end.end() - start > MAX_HEAD


def protocol_class(timeout_read: float, max_connections: int, refusals: Refusals):
    """uvicorn's h11 protocol with the limits above (the `http=` argument of uvicorn.run)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy_message = (
        f"the server has {max_connections} connections open, its limit (--max-connections); "
        "retry shortly"
    )

    async def busy(scope, receive, send):
        body = error_body(503, busy_message, "unavailable_error")
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        head += [(b"connection", b"close"), (b"retry-after", b"1")]
        await send({"type": "http.response.start", "status": 503, "headers": head})
        await send({"type": "http.response.body", "body": body})

    class LimitedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.deadline = self.held = None
            self.busy = len(self.connections) > max_connections
            if refusals.metrics is not None:
                refusals.metrics.connections_open += 1
            if self.busy:
                self.app = busy  # its request, if it comes in time, gets the 503
                refusals(
                    "too_many_connections",
                    f"answering 503: {len(self.connections)} connections open, over "
                    f"--max-connections {max_connections}",
                )
            self._watch()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self.held is not None:
                self.held.cancel()
            if refusals.metrics is not None:
                refusals.metrics.connections_open -= 1
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            hold = self.cycle.scope.get(HOLD) if self.cycle is not None else None
            if hold and not self.transport.is_closing():
                # A 429 for the client's request rate: nothing more is read from it, pipelined
                # requests included, until its Retry-After (serve/ratelimit.py). Past half the
                # connections, it is closed instead: held ones must not crowd out other clients.
                if len(self.connections) > max_connections // 2:
                    self.transport.close()
                    return
                self.flow.pause_reading()
                self.held = self.loop.call_later(hold, self._release)
                return
            super().on_response_complete()
            self._watch()

        def _release(self) -> None:
            self.held = None
            if not self.transport.is_closing():
                super().on_response_complete()  # resumes reading, answers what was pipelined
                self._watch()

        def handle_events(self) -> None:
            # Every head passes here before h11 parses it: a connection's first, each next
            # one after a response (pipelined ones wait in h11's buffer until then).
            if self.conn.their_state is h11.IDLE and _head_too_big(self.conn.trailing_data[0]):
                refusals("bad_http", "answered 400 to requests whose head is over 16 KiB")
                message = f"the request's head is over {MAX_HEAD // 1024} KiB; send less"
                self._close_with(_raw(400, message, "invalid_request_error"))
                return
            super().handle_events()

        def _reading(self) -> bool:
            """Waiting for a request's bytes: a new connection, a head begun, a body unread.
            An idle keep-alive connection is uvicorn's own timer's."""
            if self.transport.is_closing():
                return False
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                return True
            return state is h11.IDLE and (self.cycle is None or bool(self.conn.trailing_data[0]))

        def _watch(self) -> None:
            reading = self._reading()
            if reading and self.deadline is None:
                wait = min(timeout_read, BUSY_GRACE) if self.busy else timeout_read
                self.deadline = self.loop.call_later(wait, self._timed_out)
            elif not reading:
                self._disarm()

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _timed_out(self) -> None:
            self.deadline = None
            if self.transport.is_closing():
                return
            if self.busy:
                answer = _raw(503, busy_message, "unavailable_error")
            else:
                message = f"the request was not received within {timeout_read:g} s (--timeout-read)"
                answer = _raw(408, message, "invalid_request_error")
                refusals("read_timeout", f"closed connections: {message}")
            self._close_with(answer)

        def send_400_response(self, msg: str) -> None:
            refusals("bad_http", "answered 400 to requests that are not valid HTTP/1.1")
            message = "the request is not valid HTTP/1.1, or its head is over 16 KiB"
            self._close_with(_raw(400, message, "invalid_request_error"))

        def _close_with(self, answer: bytes) -> None:
            """Write `answer` unless a response is under way, then close; the app, if it waits
            for the body, is told that the client left."""
            cycle = self.cycle if self.cycle and not self.cycle.response_complete else None
            started = cycle is not None and cycle.response_started
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not started:
                self.transport.write(answer)
            if cycle is not None:
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

    return LimitedH11
