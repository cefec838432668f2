"""POST /v1/completions: a prompt (or a batch of them) completed, streamed as `text_completion`
chunks or answered whole with a choice for each prompt, through the answer skeleton of
`doel.serve.edge.answer`; echo and logprobs as OpenAI's legacy completions shape them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from doel.serve.core.grammar_limits import compiled
from doel.serve.core.logprobs import Record
from doel.serve.core.service import Piece, Service
from doel.serve.core.structured import Format
from doel.serve.edge.answer import envelope, events, joined, usage_of
from doel.serve.endpoints.protocol import Choice, Completion, CompletionRequest, Logprobs, Usage


async def format_of(svc: Service, req: CompletionRequest) -> Format | None:
    """response_format compiled off the event loop, bounded in time (`structured.compiled`)."""
    spec = req.format_spec()
    return None if spec is None else await compiled("response_format", svc.compile_format, spec)


async def pieces(svc: Service, req: CompletionRequest) -> AsyncIterator[Piece]:
    fmt = await format_of(svc, req)
    async with contextlib.aclosing(svc.complete(req, fmt=fmt)) as run:
        async for p in run:
            yield p


def stream(
    svc: Service, req: CompletionRequest, pieces: AsyncIterator[Piece]
) -> AsyncIterator[str]:
    def chunks(p: Piece) -> list[dict]:
        # Each chunk names all its choice's fields, nulls included; the last carries the
        # usage whether or not it was asked for (and with include_usage, one more does).
        choice = Choice(text=p.text, finish_reason=p.finish_reason).model_dump()
        usage = {"usage": usage_of(p).model_dump()} if p.finish_reason else {}
        return [{"choices": [choice]} | usage]

    head = envelope("cmpl", "text_completion", svc.name)
    return events(head, pieces, chunks, req.include_usage())


async def one_choice(
    svc: Service,
    req: CompletionRequest,
    index: int,
    prompt,
    slots: asyncio.Semaphore,
    fmt: Format | None = None,
) -> tuple[Choice, int, int, int]:
    """One prompt's choice, whole: its pieces joined (behind the prompt with echo), and its
    prompt, completion and cached prompt token counts."""
    record = None if req.logprobs is None else Record(req.logprobs, req.echo)
    async with slots:
        text, last = await joined(svc.complete(req, prompt, record, fmt))
    logprobs = None
    if record is not None:
        lp = await svc.in_thread(svc.logprobs, last.ids, last.prompt_tokens, record, req.echo)
        logprobs = Logprobs(**lp)
    if req.echo:
        shown = prompt if isinstance(prompt, str) else await svc.in_thread(svc.decode, prompt)
        text = shown + text
    choice = Choice(text=text, index=index, logprobs=logprobs, finish_reason=last.finish_reason)
    return choice, last.prompt_tokens, last.completion_tokens, last.cached_tokens


async def whole(svc: Service, req: CompletionRequest) -> Completion:
    """A non-streamed completion: a choice for each prompt, usage summed over them. The
    prompts of a batch run side by side, as many at once as the engine has slots, so that
    one request takes no more places in the queue than that."""
    slots, fmt = asyncio.Semaphore(svc.engine.slots), await format_of(svc, req)
    jobs = [
        asyncio.ensure_future(one_choice(svc, req, i, p, slots, fmt))
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
    choices = [d[0] for d in done]
    return Completion(**envelope("cmpl", "text_completion", svc.name), choices=choices, usage=usage)
