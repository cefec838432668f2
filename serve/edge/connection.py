"""`LimitedH11`: uvicorn's h11 protocol with the limits the app cannot see, per connection:

- one read deadline per request, from the connection's opening (or the first byte after a
  keep-alive pause) to the body's last byte; past it, a 408 in the OpenAI error shape, then close;
- over `max_connections` open, a 503 to its request, and only `BUSY_GRACE` to send it;
- after a 429 for the client's request rate (ratelimit.HOLD in its scope), nothing more read
  from the connection until its Retry-After (closed instead past half of `max_connections`);
- the 400 for a request that is not HTTP, or whose head is over MAX_HEAD, in the error shape;
- a response the app gave up on (its write deadline, --write-timeout) with bytes still unsent is
  aborted, not closed: a close waits to flush them to a client that stopped reading, so its
  socket would stay open, counted against `max_connections`, for as long as the client likes.

Why: uvicorn's h11 protocol arms no timer until a first response is complete, so a connection
that sends nothing, half a request, or less body than it announced stays open for ever; its
`limit_concurrency` answers only once a whole request has arrived, so idle connections over the
limit still hold a file descriptor each; and h11 refuses a head over its limit only while it is
incomplete, so one sent whole in a single write is measured here before h11 parses it.
"""

from __future__ import annotations

import functools
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from doel.serve.edge.limits import Refusals
from doel.serve.edge.ratelimit import HOLD
from doel.serve.edge.refusal import raw_error, send_error

BUSY_GRACE = 1.0  # seconds a connection over the limit has to send the request its 503 answers
MAX_HEAD = 16 * 1024  # bytes of a request's line and headers, its blank line included
HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a head (it accepts bare LF lines too)


def head_too_big(buffered: bytes) -> bool:
    """Whether the head at the start of `buffered` (all of it, or its start) is over MAX_HEAD.
    A buffer within the limit holds no head over it, and is not searched."""
    if len(buffered) <= MAX_HEAD:
        return False
    start = len(buffered) - len(buffered.lstrip(b"\r\n"))  # h11 skips blank lines before one
    end = HEAD_END.search(buffered, start, start + MAX_HEAD + 2)
    return end is None or end.end() - start > MAX_HEAD


def protocol_class(
    timeout_read: float, max_connections: int, refusals: Refusals
) -> type[LimitedH11]:
    """`LimitedH11` with these limits: the `http=` argument of uvicorn.run."""
    busy = (
        f"the server has {max_connections} connections open, its limit (--max-connections); "
        "retry shortly"
    )
    limits = {"timeout_read": timeout_read, "max_connections": max_connections}
    return type("LimitedH11", (LimitedH11,), {**limits, "refusals": refusals, "busy_message": busy})


async def _busy(message: str, scope, receive, send) -> None:
    """The app of a connection over the limit: its request, if it comes in time, gets a 503."""
    headers = [(b"connection", b"close"), (b"retry-after", b"1")]
    await send_error(send, 503, message, "unavailable_error", headers)


class _AbortUnfinished:
    """The connection's transport, whose `close` aborts instead while the response under way is
    unfinished and bytes wait to be sent (uvicorn closes so when the app returns early)."""

    def __init__(self, transport, protocol: LimitedH11):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        cycle = self._protocol.cycle
        unfinished = cycle is not None and cycle.response_started and not cycle.response_complete
        if unfinished and self._transport.get_write_buffer_size() > 0:
            self._transport.abort()
        else:
            self._transport.close()


class LimitedH11(H11Protocol):
    timeout_read: float
    max_connections: int
    refusals: Refusals
    busy_message: str

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = _AbortUnfinished(transport, self)  # what each request's cycle gets
        self.deadline = self.held = None
        self.busy = len(self.connections) > self.max_connections
        if self.refusals.metrics is not None:
            self.refusals.metrics.connections_open += 1
        if self.busy:
            self.app = functools.partial(_busy, self.busy_message)
            self.refusals(
                "too_many_connections",
                f"answering 503: {len(self.connections)} connections open, over "
                f"--max-connections {self.max_connections}",
            )
        self._watch()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.held is not None:
            self.held.cancel()
        if self.refusals.metrics is not None:
            self.refusals.metrics.connections_open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        hold = self.cycle.scope.get(HOLD) if self.cycle is not None else None
        if hold and not self.transport.is_closing():
            # A 429 for the client's request rate: nothing more is read from it, pipelined
            # requests included, until its Retry-After. Past half the connections, it is
            # closed instead: held ones must not crowd out other clients.
            if len(self.connections) > self.max_connections // 2:
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
        # Every head passes here before h11 parses it: a connection's first, each next one
        # after a response (pipelined ones wait in h11's buffer until then).
        if self.conn.their_state is h11.IDLE and head_too_big(self.conn.trailing_data[0]):
            self.refusals("bad_http", "answered 400 to requests whose head is over 16 KiB")
            message = f"the request's head is over {MAX_HEAD // 1024} KiB; send less"
            self._close_with(raw_error(400, message, "invalid_request_error"))
            return
        super().handle_events()

    def _reading(self) -> bool:
        """Waiting for a request's bytes: a new connection, a head begun, a body unread. An
        idle keep-alive connection is uvicorn's own timer's."""
        if self.transport.is_closing():
            return False
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        return state is h11.IDLE and (self.cycle is None or bool(self.conn.trailing_data[0]))

    def _watch(self) -> None:
        reading = self._reading()
        if reading and self.deadline is None:
            wait = min(self.timeout_read, BUSY_GRACE) if self.busy else self.timeout_read
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
            answer = raw_error(503, self.busy_message, "unavailable_error")
        else:
            message = (
                f"the request was not received within {self.timeout_read:g} s (--timeout-read)"
            )
            answer = raw_error(408, message, "invalid_request_error")
            self.refusals("read_timeout", f"closed connections: {message}")
        self._close_with(answer)

    def send_400_response(self, msg: str) -> None:
        self.refusals("bad_http", "answered 400 to requests that are not valid HTTP/1.1")
        message = "the request is not valid HTTP/1.1, or its head is over 16 KiB"
        self._close_with(raw_error(400, message, "invalid_request_error"))

    def _close_with(self, answer: bytes) -> None:
        """Write `answer` unless a response is under way, then close; the app, if it waits for
        the body, is told that the client left."""
        cycle = self.cycle if self.cycle and not self.cycle.response_complete else None
        started = cycle is not None and cycle.response_started
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not started:
            self.transport.write(answer)
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
