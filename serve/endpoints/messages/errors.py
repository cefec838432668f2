"""Anthropic's error shape, `{"type": "error", "error": {"type": ..., "message": ...}}`, for
every refusal of the Messages routes: `AnthropicErrors` rewrites the OpenAI-shaped body of any
error response under /v1/messages (a route's 400, a 404 for a model, the Guard's 401, 413 and
429), so that the server keeps one place that refuses and the official Anthropic client raises
its own exception classes, message included. A stream's error event is `error_dict`'s too.

Anthropic names an error's type by its status (its API's errors page); any other status is an
`invalid_request_error` below 500 and an `api_error` from it.
"""

from __future__ import annotations

import json

from doel.contracts.errors import error_dict as openai_error

PATH = "/v1/messages"
KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def kind(status: int) -> str:
    return KINDS.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_dict(status: int, message: str) -> dict:
    # the same text as OpenAI's shape (lone surrogates escaped)
    said = openai_error(status, message, "")["error"]["message"]
    return {"type": "error", "error": {"type": kind(status), "message": said}}


def rewritten(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body in Anthropic's shape; another body as it was."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body
    return json.dumps(error_dict(status, str(message))).encode()


class AnthropicErrors:
    """ASGI middleware: the error responses of requests under /v1/messages in Anthropic's
    shape (module docstring). An error body is one small JSON document, so it is held and
    rewritten whole; a 200, a stream included, passes as it comes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            return await self.app(scope, receive, send)
        start: dict | None = None
        body = b""

        async def rewrite(message):
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return None
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body", False):
                return None
            new = rewritten(start["status"], body)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", b"%d" % len(new)))
            await send(start | {"headers": headers})
            return await send({"type": "http.response.body", "body": new})

        return await self.app(scope, receive, rewrite)
