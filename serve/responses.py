"""POST /v1/responses, the Responses API: served as a chat completion (serve/chat.py: the same
template, limits, scheduler and constrained decoding) and answered in its own shapes: one
Response object, or the event stream the official client parses (response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed, or response.incomplete when
max_output_tokens or the context cut the text), each with its sequence_number.

`text.format` json_schema is enforced as chat's response_format is (serve/structured.py): a
reply cut short is "incomplete", never a completed document that does not parse. Stateless:
serve/protocol_responses.py says what that refuses and why.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from doel.serve import chat
from doel.serve.completions import joined
from doel.serve.protocol_chat import ChatCompletionRequest
from doel.serve.protocol_responses import (
    ResponsesRequest,
    message_item,
    output_text,
    usage,
)
from doel.serve.refusal import RequestError
from doel.serve.service import Piece, Service


def as_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req` (its sampling settings, limit and cache partition)."""
    body = {"messages": req.messages(), "max_tokens": req.max_output_tokens}
    body |= {k: getattr(req, k) for k in ("temperature", "top_p") if getattr(req, k) is not None}
    try:
        out = ChatCompletionRequest(**body)
    except ValidationError as e:  # checked on `input` already; said in its words if not
        raise RequestError(400, f"input: {e.errors()[0]['msg']}", "input") from None
    out.cache = req.cache
    return out


async def pieces(svc: Service, req: ResponsesRequest) -> AsyncIterator[Piece]:
    req.refuse_state()
    spec = req.format_spec()
    fmt = None if spec is None else await svc.in_thread(svc.compile_format, spec, "text.format")
    async with contextlib.aclosing(chat.pieces(svc, as_chat(req), fmt)) as run:
        async for p in run:
            yield p


def response(head: dict, req: ResponsesRequest, status: str, output: list, last: Piece | None):
    """The Response object: `head` (id, created_at, model), the request's settings, status."""
    done = last is not None
    return (
        head
        | req.echo()
        | {
            "object": "response",
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "output": output,
            "usage": usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
            if done
            else None,
            "completed_at": int(time.time()) if status == "completed" else None,
        }
    )


def _head(svc: Service) -> dict:
    return {"id": f"resp_{uuid.uuid4().hex}", "created_at": int(time.time()), "model": svc.name}


def _status(last: Piece) -> str:
    return "incomplete" if last.finish_reason == "length" else "completed"


async def whole(svc: Service, req: ResponsesRequest) -> dict:
    text, last = await joined(pieces(svc, req))
    status = _status(last)
    item = message_item(f"msg_{uuid.uuid4().hex}", status, [output_text(text)])
    return response(_head(svc), req, status, [item], last)


async def stream(
    svc: Service, req: ResponsesRequest, pieces: AsyncIterator[Piece]
) -> AsyncIterator[str]:
    head, item_id, seq = _head(svc), f"msg_{uuid.uuid4().hex}", itertools.count()
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    started = response(head, req, "in_progress", [], None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    yield event(
        "response.output_item.added", output_index=0, item=message_item(item_id, "in_progress", [])
    )
    yield event("response.content_part.added", **at, part=output_text(""))
    text, last = [], None
    async with contextlib.aclosing(pieces):
        async for last in pieces:
            if last.text:
                text.append(last.text)
                yield event("response.output_text.delta", **at, delta=last.text, logprobs=[])
    whole_text, status = "".join(text), _status(last)
    part = output_text(whole_text)
    item = message_item(item_id, status, [part])
    yield event("response.output_text.done", **at, text=whole_text, logprobs=[])
    yield event("response.content_part.done", **at, part=part)
    yield event("response.output_item.done", output_index=0, item=item)
    final = response(head, req, status, [item], last)
    yield event(f"response.{status}", response=final)
