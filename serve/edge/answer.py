"""The skeleton every answer made of pieces shares: one envelope (id, object, created, model) on
the whole answer and on each streamed chunk, the stream's usage chunk and [DONE], the pieces
joined for a whole answer, a refusal before the first piece as an HTTP error, and the watch for
a client that leaves, which cancels its work so that the engine is freed at once. A route that
answers from pieces is a module that is a `Route`, which `respond` serves; the engine work
itself is the Service's.

A stream is past its HTTP status once its head is written, so how it ends is said in its own
events, and every end frees its work at once:
- A failure after the first event (the engine, a grammar, a bug) ends the stream with its
  protocol's failure event (`events`: an OpenAI error object, which the official client raises
  as APIError, then [DONE]; the Responses API: response.failed), never a cut connection that a
  client reads as a network error; /metrics counts it as the failure it was (metrics.ENDED).
- One owner closes the work: the response (`EventStream`) closes the events and the service's
  pieces whatever ended it: the last event, a failure, the client leaving, a cancelled task, or
  a write that waited past --write-timeout (a client that stopped reading would otherwise hold
  its slot, and its model's lease, for ever). Starlette's own StreamingResponse leaves a body
  it stopped reading to the garbage collector, and the slot busy until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from doel.contracts.errors import error_dict
from doel.serve.core.service import Piece, RequestError, Service
from doel.serve.edge.bounds import limits
from doel.serve.edge.guard import TENANT
from doel.serve.edge.metrics import ENDED
from doel.serve.edge.tenants import DEFAULT_MODE, partition
from doel.serve.endpoints.protocol import Usage, sse

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
CLIENT_GONE = 499  # nginx's status for a client that closed the connection; /metrics counts it
log = logging.getLogger("doel.serve")


def envelope(prefix: str, kind: str, model: str) -> dict:
    """An answer's id, object, creation time and model, which each of its chunks repeats."""
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    return {"id": rid, "object": kind, "created": created, "model": model}


def usage_of(p: Piece) -> Usage:
    return Usage.of(p.prompt_tokens, p.completion_tokens, p.cached_tokens)


async def events(
    head: dict,
    pieces: AsyncIterator[Piece],
    chunks: Callable[[Piece], Iterable[dict]],
    with_usage: bool,
    first: Iterable[dict] = (),
) -> AsyncIterator[str]:
    """A streamed answer: the `first` chunks, then each piece's `chunks`, each in the envelope
    `head`; after the last piece, `with_usage`, one more with the usage and no choices (as
    OpenAI); then [DONE]. A failure ends it with an error event and [DONE], then goes on to
    the response that counts it (`EventStream`, which closes `pieces` too)."""
    try:
        for chunk in first:
            yield sse(head | chunk)
        async for p in pieces:
            for chunk in chunks(p):
                yield sse(head | chunk)
            if p.finish_reason and with_usage:
                yield sse(head | {"choices": [], "usage": usage_of(p).model_dump()})
    except Exception as e:
        yield error_event(e)
        yield DONE
        raise
    yield DONE


def failure(e: Exception) -> RequestError:
    """What a client is told of `e`: a refusal as it is; anything else (an engine fault, a
    bug) as a 500 that names only its type, as the app's error handler does."""
    if isinstance(e, RequestError):
        return e
    why = f"internal error ({type(e).__name__}); the server's log has the details"
    return RequestError(500, why, kind="server_error")


def error_event(e: Exception) -> str:
    """The event that ends a failed stream: OpenAI's error object, the one a refusal's body
    holds; the official client raises it as APIError."""
    f = failure(e)
    return sse(error_dict(f.status, f.message, f.kind, f.param))


async def joined(pieces: AsyncIterator[Piece]) -> tuple[str, Piece]:
    """A whole answer's text, and its last piece (the finish reason and the token counts)."""
    text, last = [], None
    async with contextlib.aclosing(pieces):
        async for last in pieces:
            text.append(last.text)
    return "".join(text), last


async def first_piece(pieces: AsyncIterator[Piece]) -> Resumed:
    """Run the generator up to its first piece, so that a refusal (queue full) is an HTTP
    error rather than a broken stream."""
    return Resumed(await anext(pieces), pieces)


class Resumed:
    """`pieces` with its first piece put back in front. Closing it (a client gone) closes
    `pieces`, which frees the engine, even before anything was read from it: a wrapping async
    generator that has not started runs no cleanup when closed, and `async for` alone would
    leave it to the garbage collector."""

    def __init__(self, first: Piece, pieces: AsyncIterator[Piece]):
        self._first: Piece | None = first
        self._pieces = pieces

    def __aiter__(self) -> Resumed:
        return self

    async def __anext__(self) -> Piece:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._pieces)

    async def aclose(self) -> None:
        self._first = None
        await self._pieces.aclose()


async def disconnected(request: Request) -> None:
    """Returns once the client has gone. The body is read by then, so the next message the
    server has for this request is `http.disconnect` (sent when the response is complete too)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`await work`, unless the client disconnects first: then `work` is cancelled, which
    closes the service's generator and so takes the request out of the queue or its slot at
    once (a non-streamed request used to run to max_tokens for nobody), and the answer is a
    499 that no one reads but /metrics counts."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client left, or this handler is being cancelled
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise RequestError(499, "the client closed the connection", kind="client_closed")
    return task.result()


@runtime_checkable
class Route(Protocol):
    """What a route module provides for `respond`, each taking its own request model: `whole`,
    the answer in one body; `pieces`, the answer's pieces as the service gives them (a refusal
    raised before the first); `stream`, those pieces as server-sent events."""

    def pieces(self, svc: Service, req: Any) -> AsyncIterator[Piece]: ...

    def stream(
        self, svc: Service, req: Any, pieces: AsyncIterator[Piece]
    ) -> AsyncIterator[str]: ...

    def whole(self, svc: Service, req: Any) -> Coroutine[Any, Any, Any]: ...


async def respond(request: Request, route: Route, svc: Service, req):
    """The answer of `route` (the completions, chat or responses module): whole, or streamed.
    The request's prefix cache partition is set here, from its key's tenant (the Guard's) and
    its salt."""
    mode = getattr(request.app.state, "prefix_cache", DEFAULT_MODE)
    req.cache = partition(mode, request.scope.get(TENANT), req.cache_salt)
    if not req.stream:
        return await unless_gone(request, route.whole(svc, req))
    # Until the first piece (in the queue, then the prompt going in), nothing watches the
    # connection but this; from then on the streaming response does, and owns the pieces.
    pieces = await unless_gone(request, first_piece(route.pieces(svc, req)))
    try:
        body = route.stream(svc, req, pieces)
    except BaseException:
        await pieces.aclose()
        raise
    return EventStream(body, pieces, limits().write_timeout)


class EventStream(StreamingResponse):
    """A stream of server-sent events that owns its work: `body`, the events, made from
    `pieces`, the service's. Whatever ends it, both are closed before it returns (the slot is
    free, and the app's ModelContext ends the model's lease), and its end is put in the scope
    for /metrics (`ENDED`): 200, a failure's status (the body's last events said it), or 499
    for a client that left or let a write wait `write_timeout` seconds."""

    def __init__(self, body: AsyncIterator[str], pieces: AsyncIterator[Piece], write_timeout):
        super().__init__(body, media_type="text/event-stream")
        self.pieces, self.write_timeout, self.left = pieces, write_timeout, False

    async def __call__(self, scope, receive, send) -> None:
        status = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                status = await self._write(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled task closes them too
                try:
                    await self.body_iterator.aclose()
                finally:
                    await self.pieces.aclose()
            status = CLIENT_GONE if status is None and self.left else status
            if status is not None:
                scope[ENDED] = status

    async def _watch(self, receive, writing: anyio.CancelScope) -> None:
        """Stop the writing once the client has gone."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left = True
        writing.cancel()

    async def _write(self, send) -> int:
        """The head, the events, the end; the status the stream ended with."""
        start = {"type": "http.response.start", "status": self.status_code}
        try:
            await self._send(send, start | {"headers": self.raw_headers})
            status = await self._events(send)
            await self._send(send, {"type": "http.response.body", "body": b""})
        except TimeoutError:
            log.warning(
                "a client took nothing for %g s (--write-timeout); its stream ended",
                self.write_timeout,
            )
            return CLIENT_GONE
        except OSError:  # a send on a closed connection (how ASGI 2.4 servers say it)
            return CLIENT_GONE
        return status

    async def _events(self, send) -> int:
        while True:
            try:
                event = await anext(self.body_iterator)
            except StopAsyncIteration:
                return 200
            except Exception as e:  # its last events said why; here it is logged and counted
                quiet = isinstance(e, RequestError)
                log.error("a stream failed after it began: %s", e, exc_info=not quiet)
                return failure(e).status
            body = {"type": "http.response.body", "body": event.encode(), "more_body": True}
            await self._send(send, body)

    async def _send(self, send, message: dict) -> None:
        with anyio.fail_after(self.write_timeout):
            await send(message)
