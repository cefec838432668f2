"""Serving a completion request: the streamed events or the whole answer, and the watch for a
client that leaves. The router (serve/app.py) calls `stream`, `first_piece`, `whole` and
`unless_gone`; the engine work itself is the Service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request

from doel.serve.logprobs import Record
from doel.serve.protocol import Choice, Completion, CompletionRequest, Logprobs, Usage, sse
from doel.serve.service import RequestError, Service

T = TypeVar("T")


async def stream(svc: Service, req: CompletionRequest, pieces) -> AsyncIterator[str]:
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    async with contextlib.aclosing(pieces):
        async for p in pieces:
            usage = None
            if p.finish_reason:
                usage = Usage.of(p.prompt_tokens, p.completion_tokens, p.cached_tokens)
            choice = Choice(text=p.text, finish_reason=p.finish_reason)
            chunk = Completion(
                id=rid, created=created, model=svc.name, choices=[choice], usage=usage
            )
            yield sse(chunk.model_dump(exclude_none=True) | {"choices": [choice.model_dump()]})
            if usage and req.include_usage():
                last = Completion(id=rid, created=created, model=svc.name, choices=[], usage=usage)
                yield sse(last.model_dump())
    yield "data: [DONE]\n\n"


async def first_piece(pieces):
    """Run the generator up to its first piece, so that a refusal (queue full) is an HTTP
    error rather than a broken stream."""
    first = await anext(pieces)

    async def again():
        # Closing this wrapper (a client gone) must close the service's generator too, which
        # frees the engine; `async for` alone would leave that to the garbage collector.
        async with contextlib.aclosing(pieces):
            yield first
            async for p in pieces:
                yield p

    return again()


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


async def one_choice(
    svc: Service, req: CompletionRequest, index: int, prompt, slots: asyncio.Semaphore
) -> tuple[Choice, int, int, int]:
    """One prompt's choice, whole: its pieces joined (behind the prompt with echo), and its
    prompt, completion and cached prompt token counts."""
    record = None if req.logprobs is None else Record(req.logprobs, req.echo)
    async with slots:
        pieces = svc.complete(req, prompt, record)
        text, last = [], None
        async with contextlib.aclosing(pieces):
            async for last in pieces:
                text.append(last.text)
    logprobs = None
    if record is not None:
        lp = await svc.in_thread(svc.logprobs, last.ids, last.prompt_tokens, record, req.echo)
        logprobs = Logprobs(**lp)
    if req.echo:
        shown = prompt if isinstance(prompt, str) else await svc.in_thread(svc.decode, prompt)
        text.insert(0, shown)
    choice = Choice(
        text="".join(text), index=index, logprobs=logprobs, finish_reason=last.finish_reason
    )
    return choice, last.prompt_tokens, last.completion_tokens, last.cached_tokens


async def whole(svc: Service, req: CompletionRequest) -> Completion:
    """A non-streamed completion: a choice for each prompt, usage summed over them. The
    prompts of a batch run side by side, as many at once as the engine has slots, so that
    one request takes no more places in the queue than that."""
    slots = asyncio.Semaphore(svc.engine.slots)
    jobs = [
        asyncio.ensure_future(one_choice(svc, req, i, p, slots))
        for i, p in enumerate(req.prompts())
    ]
    try:
        done = await asyncio.gather(*jobs)
    except BaseException:  # one refused (or the client gone): the others stop too
        for j in jobs:
            j.cancel()
        await asyncio.wait(jobs)
        raise
    usage = Usage.of(*(sum(d[i] for d in done) for i in (1, 2, 3)))
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choices = [d[0] for d in done]
    return Completion(id=rid, created=created, model=svc.name, choices=choices, usage=usage)
