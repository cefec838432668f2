"""Anthropic's error shape (serve/endpoints/messages/errors.py): an OpenAI-shaped refusal under
/v1/messages rewritten, its type Anthropic's for the status and its length fixed; other paths,
a 200 and a body that is not an error left as they are."""

from __future__ import annotations

import asyncio
import json

import pytest

from doel.contracts.errors import error_body
from doel.serve.endpoints.messages.errors import AnthropicErrors, rewritten


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
     (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
     (503, "overloaded_error"), (421, "invalid_request_error"), (502, "api_error")],
)  # fmt: skip
def test_a_refusal_is_anthropics_shape_with_the_type_of_its_status(status, kind):
    got = json.loads(rewritten(status, error_body(status, "why", "x", "p")))
    assert got == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert rewritten(status, b"not json") == b"not json"


def _served(path: str, status: int, body: bytes) -> tuple[dict, bytes]:
    async def app(scope, receive, send):
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await send({"type": "http.response.body", "body": body[5:]})

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path}
    asyncio.run(AnthropicErrors(app)(scope, None, send))
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_middleware_rewrites_only_errors_under_v1_messages():
    openai = error_body(401, "missing key", "authentication_error")
    start, body = _served("/v1/messages/count_tokens", 401, openai)
    assert json.loads(body)["error"] == {"type": "authentication_error", "message": "missing key"}
    assert dict(start["headers"])[b"content-length"] == b"%d" % len(body)
    assert _served("/v1/chat/completions", 401, openai)[1] == openai
    assert _served("/v1/messages", 200, b'{"type": "message"}')[1] == b'{"type": "message"}'
