"""POST /v1/messages, Anthropic's Messages API: served as a chat completion (`chat.pieces`: the
same template, limits, scheduler, prefix cache and constrained tool calls) and answered in
Anthropic's shapes: one Message, or the event stream the official client parses
(message_start, ping, then per content block content_block_start, content_block_delta with a
text_delta or an input_json_delta..., content_block_stop; then message_delta with the
stop_reason and the usage, and message_stop). POST /v1/messages/count_tokens: the prompt's
tokens, rendered as the request would be.

Tools are chat's (`tools.plan`): tool_choice `auto` shows them and reads a `<tool_call>` the
model writes, `any` and `tool` constrain the reply to a call whose input validates against the
tool's input_schema, `none` hides them. A call is a `tool_use` block; a reply that called
stops with `tool_use`. stop_reason is `end_turn` (end of turn or EOS), `max_tokens` (the limit
or the context), `stop_sequence` (with the string that matched) or `tool_use`.

A stream that fails after its first event ends with an `error` event in Anthropic's shape,
which the official client raises; every refusal before it is an HTTP error in that shape too
(`errors.AnthropicErrors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from doel.serve.core.service import Piece, Service
from doel.serve.edge.answer import failure, joined
from doel.serve.edge.refusal import RequestError
from doel.serve.endpoints.chat import route as chat
from doel.serve.endpoints.chat import tools
from doel.serve.endpoints.chat.protocol import ChatCompletionRequest
from doel.serve.endpoints.messages.errors import error_dict
from doel.serve.endpoints.messages.protocol import (
    STOP_REASONS,
    CountTokensRequest,
    MessagesRequest,
    message,
    usage,
)

PARAMS = {"stop": "stop_sequences"}  # chat's names for this route's fields


def as_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves `req`, made once a request; a prefill (a last assistant
    text) is the reply's forced start, as a required tool call's head is."""
    if getattr(req, "_chat", None) is not None:
        return req._chat
    try:
        body = req.chat_body() | (req.sampling() if isinstance(req, MessagesRequest) else {})
        out = ChatCompletionRequest(**body)
    except ValueError as e:  # pydantic's ValidationError is one too
        raise _refusal(e) from None
    out.cache = req.cache
    plan = tools.plan(out)
    if prefill := req.prefill():
        if plan.prefix:
            raise RequestError(
                400,
                "a conversation that ends with the assistant's text is continued from it, "
                "which a required tool call (tool_choice any or tool) cannot be; end with the "
                "user's turn",
                "messages",
            )
        out._tool_plan = dataclasses.replace(plan, prefix=prefill)
    if isinstance(req, MessagesRequest):
        req._chat = out
    return out


def _refusal(e: ValueError) -> RequestError:
    if not isinstance(e, ValidationError):
        param = str(e).partition(":")[0].partition("[")[0] or "messages"
        return RequestError(400, str(e), param)
    first = e.errors()[0]
    where = [str(x) for x in first.get("loc", ())]
    param = PARAMS.get(where[0], where[0]) if where else "messages"
    return RequestError(400, f"{'.'.join([param, *where[1:]])}: {first['msg']}", param)


async def count(svc: Service, req: CountTokensRequest) -> dict:
    """POST /v1/messages/count_tokens: {"input_tokens": N}, the ids the prompt would be."""
    creq = as_chat(req)
    ids = await svc.in_thread(chat.prompt_ids, svc, creq, tools.plan(creq))
    return {"input_tokens": len(ids)}


async def pieces(svc: Service, req: MessagesRequest) -> AsyncIterator[Piece]:
    creq = as_chat(req)
    if req.stream:  # message_start says the prompt's tokens before the reply
        req._prompt_tokens = len(await svc.in_thread(chat.prompt_ids, svc, creq, tools.plan(creq)))
    try:
        async with contextlib.aclosing(chat.pieces(svc, creq)) as run:
            async for p in run:
                yield p
    except RequestError as e:  # chat's words for this route's fields
        e.param = PARAMS.get(e.param, e.param)
        raise


class Blocks:
    """A reply's chat deltas (`tools.Deltas`) as Anthropic's content blocks, each opened by its
    first delta: events for a stream, and the blocks themselves for a whole Message, so that
    both say the same."""

    def __init__(self):
        self.content: list[dict] = []
        self.args: list[str] = []  # each block's input JSON so far ("" for text)

    def deltas(self, ds: list[dict]) -> list[dict]:
        return [e for d in ds for e in self.delta(d)]

    def delta(self, d: dict) -> list[dict]:
        if "content" in d:
            out = [] if self._open() == "text" else self._start({"type": "text", "text": ""})
            self.content[-1]["text"] += d["content"]
            return out + [self._delta({"type": "text_delta", "text": d["content"]})]
        call = d["tool_calls"][0]
        if "id" in call:
            block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_")}
            return self._start(block | {"name": call["function"]["name"], "input": {}})
        fragment = call["function"]["arguments"]
        self.args[-1] += fragment
        return [self._delta({"type": "input_json_delta", "partial_json": fragment})]

    def finished(self) -> list[dict]:
        """The blocks of the whole reply: each call's input parsed (a call cut short by
        max_tokens keeps what parsed: nothing)."""
        for block, args in zip(self.content, self.args):
            if block["type"] == "tool_use":
                with contextlib.suppress(json.JSONDecodeError):
                    block["input"] = json.loads(args or "{}")
        return self.content

    def stop(self) -> list[dict]:
        if not self.content:
            return []
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _open(self) -> str | None:
        return self.content[-1]["type"] if self.content else None

    def _start(self, block: dict) -> list[dict]:
        out = self.stop()
        self.content.append(block)
        self.args.append("")
        shown = block | ({"text": ""} if block["type"] == "text" else {})
        return out + [
            {"type": "content_block_start", "index": len(self.content) - 1, "content_block": shown}
        ]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}


def _end(last: Piece, deltas: tools.Deltas) -> tuple[list[dict], str, str | None]:
    """The held deltas, the stop_reason and the stop_sequence of a reply's last piece."""
    held, reason = deltas.end(last.finish_reason)
    if last.stop is not None and reason == "stop":
        return held, "stop_sequence", last.stop
    return held, STOP_REASONS[reason], None


async def whole(svc: Service, req: MessagesRequest) -> dict:
    text, last = await joined(pieces(svc, req))
    deltas, blocks = tools.Deltas(tools.plan(as_chat(req))), Blocks()
    blocks.deltas(deltas.push(text))
    held, reason, stop = _end(last, deltas)
    blocks.deltas(held)
    use = usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
    return message(_id(), svc.name, blocks.finished(), reason, stop, use)


def _id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(
    svc: Service, req: MessagesRequest, pieces: AsyncIterator[Piece]
) -> AsyncIterator[str]:
    """The Message's events from `pieces`; a failure ends them with an `error` event, then goes
    on to the response that sends them (`answer.EventStream`, which closes `pieces`)."""
    try:
        deltas, blocks = tools.Deltas(tools.plan(as_chat(req))), Blocks()
        head = message(_id(), svc.name, [], None, None, usage(req._prompt_tokens, 0, 0))
        yield event({"type": "message_start", "message": head})
        yield event({"type": "ping"})
        last = None
        async for last in pieces:
            for e in blocks.deltas(deltas.push(last.text)):
                yield event(e)
        held, reason, stop = _end(last, deltas)
        for e in blocks.deltas(held) + blocks.stop():
            yield event(e)
        use = usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        delta = {"stop_reason": reason, "stop_sequence": stop}
        yield event({"type": "message_delta", "delta": delta, "usage": use})
        yield event({"type": "message_stop"})
    except Exception as e:
        f = failure(e)
        yield event(error_dict(f.status, f.message))
        raise
