"""Serving a chat completion: messages rendered with the bundle's chat template (`ChatTemplate`),
the reply generated as completions are (the same scheduler, limits, disconnect watch and answer
skeleton, `doel.serve.edge.answer`) until the end-of-turn token or EOS,
and answered in OpenAI's chat shapes: one `chat.completion`, or `chat.completion.chunk` events
whose first delta names the role and whose last carries the finish reason (then, with
`stream_options.include_usage`, a chunk with the usage and no choices). Tools (`tools.plan`)
decide what the prompt shows, what the reply is constrained to and how its text is read: as
content, or as tool calls (deltas in a stream, assembled in a whole answer).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

from doel.serve.core.grammar_limits import compiled
from doel.serve.core.service import Piece, RequestError, Service
from doel.serve.core.structured import Format
from doel.serve.core.template import ChatError
from doel.serve.edge.answer import envelope, events, joined, usage_of
from doel.serve.endpoints.chat import tools
from doel.serve.endpoints.chat.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
)


def prompt_ids(svc: Service, req: ChatCompletionRequest, plan: tools.ToolPlan) -> list[int]:
    """The conversation's ids, refused with a 400 when it cannot be rendered or cannot fit
    (a text too long for the context is refused before it is encoded, as completions do)."""
    if svc.chat is None:
        raise RequestError(
            400,
            f"the model {svc.name!r} has no chat template (its tokenizer_config.json names "
            "none), so it cannot answer chat requests; use /v1/completions",
            "messages",
        )
    try:
        turns = req.turns()
    except ValueError as e:
        raise RequestError(400, str(e), "messages") from None
    least = svc.least_tokens("".join(t["content"] for t in turns))
    if least >= svc.context_length:
        raise RequestError(
            400,
            f"the messages are at least {least:,} tokens, but the model's context is "
            f"{svc.context_length} tokens; send fewer or shorter messages",
            "messages",
        )
    try:
        return svc.chat.ids(turns, plan.tools, plan.prefix)
    except ChatError as e:
        raise RequestError(400, str(e), "messages") from None


async def pieces(
    svc: Service, req: ChatCompletionRequest, fmt: Format | None = None
) -> AsyncIterator[Piece]:
    """The reply's pieces, as Service.complete gives a completion's; RequestError before the
    first one. `fmt`: the reply's grammar, compiled by the caller (/v1/responses' text.format);
    by default the request's response_format, or its tools'."""
    plan = tools.plan(req)
    ids = await svc.in_thread(prompt_ids, svc, req, plan)
    n, room = len(ids), svc.room()
    limit = req.limit()
    if limit is None and n >= room:
        raise RequestError(
            400,
            f"the conversation is {n} tokens, which leaves no room for a reply in {svc.room_is()}"
            "; send fewer or shorter messages",
            "messages",
        )
    # No max_tokens: what the context and the KV pool allow. Nothing is reserved for it: the
    # pool is taken as the reply grows (serve/core/scheduler.py).
    limit = room - n if limit is None else limit
    svc.check_fits(n, limit, "conversation", "messages")
    params = req.to_sampling_params(limit, svc.chat.stop_ids)
    # response_format, or a required tool call: the reply is a document of its schema
    spec = req.format_spec()
    if fmt is None and plan.grammar is not None:
        for param, schema in plan.each:
            await compiled(param, _json_schema, svc, schema, param)
        fmt = await compiled(plan.param, _lark, svc, plan.grammar, plan.param)
    elif fmt is None and plan.schema is not None:
        fmt = await compiled(plan.param, _json_schema, svc, plan.schema, plan.param)
    elif fmt is None and spec is not None:
        fmt = await compiled("response_format", svc.compile_format, spec)
    run = svc.run(ids, params, req.stops(), cache=req.cache, fmt=fmt)
    async with contextlib.aclosing(run) as run:
        async for p in run:
            yield p


def _json_schema(svc: Service, schema: dict, param: str) -> Format:
    return svc.grammars.json_schema(schema, param)  # the compilers are built on first use


def _lark(svc: Service, grammar: str, param: str) -> Format:
    return svc.grammars.lark(grammar, param)


def stream(
    svc: Service, req: ChatCompletionRequest, pieces: AsyncIterator[Piece]
) -> AsyncIterator[str]:
    # As OpenAI: with include_usage every chunk has a null usage, and one more carries it.
    empty = {"usage": None} if req.include_usage() else {}
    deltas = tools.Deltas(tools.plan(req))

    def chunk(delta: dict, finish: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"choices": [choice]} | empty

    def chunks(p: Piece) -> Iterator[dict]:
        for delta in deltas.push(p.text):
            yield chunk(delta)
        if p.finish_reason:
            held, reason = deltas.end(p.finish_reason)
            yield from map(chunk, held)
            yield chunk({}, reason)

    head = envelope("chatcmpl", "chat.completion.chunk", svc.name)
    role = chunk({"role": "assistant", "content": ""})  # the first delta names the role
    return events(head, pieces, chunks, req.include_usage(), first=[role])


async def whole(svc: Service, req: ChatCompletionRequest) -> ChatCompletion:
    text, last = await joined(pieces(svc, req))
    deltas = tools.Deltas(tools.plan(req))
    said = deltas.push(text)
    held, reason = deltas.end(last.finish_reason)
    content, calls = tools.assemble(said + held)
    message = AssistantMessage(content=content, tool_calls=calls or None)
    choice = ChatChoice(message=message, finish_reason=reason)
    return ChatCompletion(
        **envelope("chatcmpl", "chat.completion", svc.name), choices=[choice], usage=usage_of(last)
    )
