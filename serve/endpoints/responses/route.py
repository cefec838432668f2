"""POST /v1/responses, the Responses API: served as a chat completion (`chat.pieces`: the same
template, limits, scheduler and constrained decoding) and answered in its own shapes: one
Response object, or the event stream the official client parses (response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed, or response.incomplete when
max_output_tokens or the context cut the text), each with its sequence_number.

`text.format` json_schema is enforced as chat's response_format is: a
reply cut short is "incomplete", never a completed document that does not parse. Function
tools are chat's (`tools.plan`: auto, required and a named function constrained): a call is
a function_call output item, streamed as response.output_item.added (name, empty arguments),
response.function_call_arguments.delta..., response.function_call_arguments.done and
response.output_item.done. Stateless: `ResponsesRequest` says what that refuses and why.

A stream that fails after its first event ends with response.failed (the item being written
closed "incomplete" first, so that every item added is done), its Response's `error` saying
why, as the Responses API ends one; the response that sends it counts and frees it
(`answer.EventStream`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from doel.serve.core.grammar_limits import compiled
from doel.serve.core.service import Piece, Service
from doel.serve.edge.answer import failure, joined
from doel.serve.edge.refusal import RequestError
from doel.serve.endpoints.chat import route as chat
from doel.serve.endpoints.chat import tools
from doel.serve.endpoints.chat.protocol import ChatCompletionRequest
from doel.serve.endpoints.responses.protocol import (
    ResponsesRequest,
    call_item,
    message_item,
    output_text,
    usage,
)


def as_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req` (its sampling settings, limit, tools and cache
    partition), made once a request: the conversation is validated once."""
    if req._chat is None:
        req._chat = _as_chat(req)
    return req._chat


def _as_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    body = {"messages": req.messages(), "max_tokens": req.max_output_tokens, **req.chat_tools()}
    body |= {k: getattr(req, k) for k in ("temperature", "top_p") if getattr(req, k) is not None}
    try:
        out = ChatCompletionRequest(**body)
    except ValidationError as e:  # what input's items hold, checked as chat's messages
        first = e.errors()[0]
        where = [str(x) for x in first.get("loc", ())]
        param = "input" if not where or where[0] == "messages" else where[0]
        raise RequestError(400, f"{param}: {first['msg']}", param) from None
    out.cache = req.cache
    return out


async def pieces(svc: Service, req: ResponsesRequest) -> AsyncIterator[Piece]:
    req.refuse_state()
    spec = req.format_spec()
    fmt = None
    if spec is not None:
        fmt = await compiled("text.format", svc.compile_format, spec, "text.format")
    try:
        async with contextlib.aclosing(chat.pieces(svc, as_chat(req), fmt)) as run:
            async for p in run:
                yield p
    except RequestError as e:  # chat's words for what this route calls input
        e.param = "input" if e.param == "messages" else e.param
        raise


def response(
    head: dict,
    req: ResponsesRequest,
    status: str,
    output: list,
    last: Piece | None,
    error: dict | None = None,
):
    """The Response object: `head` (id, created_at, model), the request's settings, status,
    and for a failed one its `error`."""
    done = last is not None
    return (
        head
        | req.echo()
        | {
            "object": "response",
            "status": status,
            "error": error,
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
    deltas = tools.Deltas(tools.plan(as_chat(req)))
    said = deltas.push(text)
    held, _ = deltas.end(last.finish_reason)
    content, calls = tools.assemble(said + held)
    status = _status(last)
    output = [call_item(c, status) for c in calls]
    if content is not None:
        message = message_item(f"msg_{uuid.uuid4().hex}", status, [output_text(content)])
        output.insert(0, message)
    return response(_head(svc), req, status, output, last)


class Events:
    """A Response's stream: its output items opened as their first delta comes (a message
    for text, a function_call for each call), each closed with its done events."""

    def __init__(self, head: dict, req: ResponsesRequest):
        self.head, self.req, self.seq = head, req, itertools.count()
        self.output: list[dict] = []  # items closed so far
        self.open: dict | None = None  # the item being written, with its text so far
        self.begun = False  # response.created is out

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        self.begun = True
        started = response(self.head, self.req, "in_progress", [], None)
        return [self.event(f"response.{k}", response=started) for k in ("created", "in_progress")]

    def deltas(self, ds: list[dict]) -> list[str]:
        return [e for d in ds for e in self.delta(d)]

    def delta(self, d: dict) -> list[str]:
        if "content" in d:
            out = [] if self._is("message") else self.close("completed") + self._message()
            self.open["text"] += d["content"]
            return out + [
                self.event(
                    "response.output_text.delta", **self._at(), delta=d["content"], logprobs=[]
                )
            ]
        call = d["tool_calls"][0]
        if "id" in call:
            out = self.close("completed")
            item = call_item({"id": call["id"], "function": call["function"]}, "in_progress")
            self.open = {"item": item, "text": ""}
            return out + [self.item_event("added", item)]
        self.open["text"] += call["function"]["arguments"]
        fragment = call["function"]["arguments"]
        return [
            self.event("response.function_call_arguments.delta", **self._at(False), delta=fragment)
        ]

    def finish(self, last: Piece) -> list[str]:
        status = _status(last)
        out = (
            self.close(status) if self.open or self.output else self._message() + self.close(status)
        )
        final = response(self.head, self.req, status, self.output, last)
        return out + [self.event(f"response.{status}", response=final)]

    def failed(self, e: Exception) -> list[str]:
        """The end of a stream that `e` cut: the item being written closed "incomplete", then
        response.failed, whose `error` is what a refusal's body would say (a 5xx is the
        Responses API's server_error)."""
        f = failure(e)
        out = [] if self.begun else self.start()
        out += self.close("incomplete")
        error = {"code": "server_error" if f.status >= 500 else "invalid_prompt"}
        error |= {"message": f.message, "param": f.param, "type": f.kind}
        final = response(self.head, self.req, "failed", self.output, None, error)
        return out + [self.event("response.failed", response=final)]

    def close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        item, text = self.open["item"], self.open["text"]
        if item["type"] == "message":
            part, at = output_text(text), self._at()
            item = {**item, "status": status, "content": [part]}
            out = [
                self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=part),
            ]
        else:
            item = {**item, "status": status, "arguments": text}
            at = self._at(False)
            out = [self.event("response.function_call_arguments.done", **at, arguments=text)]
        self.open = None
        out.append(self.item_event("done", item))
        self.output.append(item)
        return out

    def _message(self) -> list[str]:
        item = message_item(f"msg_{uuid.uuid4().hex}", "in_progress", [])
        self.open = {"item": item, "text": ""}
        added = self.item_event("added", item)
        return [
            added,
            self.event("response.content_part.added", **self._at(), part=output_text("")),
        ]

    def item_event(self, what: str, item: dict) -> str:
        return self.event(f"response.output_item.{what}", output_index=len(self.output), item=item)

    def _is(self, kind: str) -> bool:
        return self.open is not None and self.open["item"]["type"] == kind

    def _at(self, text: bool = True) -> dict:
        at = {"item_id": self.open["item"]["id"], "output_index": len(self.output)}
        return at | ({"content_index": 0} if text else {})


async def stream(
    svc: Service, req: ResponsesRequest, pieces: AsyncIterator[Piece]
) -> AsyncIterator[str]:
    """The Response's events from `pieces`; a failure ends them with response.failed, then
    goes on to the response that sends them (`answer.EventStream`, which closes `pieces`)."""
    events = Events(_head(svc), req)
    try:
        deltas = tools.Deltas(tools.plan(as_chat(req)))
        for e in events.start():
            yield e
        last = None
        async for last in pieces:
            for e in events.deltas(deltas.push(last.text)):
                yield e
        held, _ = deltas.end(last.finish_reason)
        for e in events.deltas(held) + events.finish(last):
            yield e
    except Exception as error:
        for e in events.failed(error):
            yield e
        raise
