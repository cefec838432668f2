"""The skeleton every answer made of pieces shares: one envelope (id, object, created, model) on
the whole answer and on each streamed chunk, the stream's usage chunk and [DONE], the pieces
joined for a whole answer, a refusal before the first piece as an HTTP error, and the watch for
a client that leaves, which cancels its work so that the engine is freed at once. A route that
answers from pieces is a module that is a `Route`, which `respond` serves; the engine work
itself is the Service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

from fastapi import Request
from fastapi.responses import StreamingResponse

from doel.serve.guard import TENANT
from doel.serve.protocol import Usage, sse
from doel.serve.service import Piece, RequestError, Service
from doel.serve.tenants import DEFAULT_MODE, partition

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


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
    OpenAI); then [DONE]. Closing it (a client gone) closes `pieces`, which frees the engine."""
    async with contextlib.aclosing(pieces):
        for chunk in first:
            yield sse(head | chunk)
        async for p in pieces:
            for chunk in chunks(p):
                yield sse(head | chunk)
            if p.finish_reason and with_usage:
                yield sse(head | {"choices": [], "usage": usage_of(p).model_dump()})
    yield DONE


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
    # connection but this; from then on the streaming response does.
    pieces = await unless_gone(request, first_piece(route.pieces(svc, req)))
    return StreamingResponse(route.stream(svc, req, pieces), media_type="text/event-stream")
