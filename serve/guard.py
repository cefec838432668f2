"""ASGI middleware in front of every route: the header count, the API key, the body-size limit.

It is plain ASGI rather than FastAPI dependencies so that it also covers 404s, the OpenAPI page
and bodies sent without a Content-Length (chunked), which are read up to the limit and replayed.
"""

from __future__ import annotations

import hmac
import json

# Answered without a key: probes, and the playground page (it holds no data; its requests
# carry the key typed into it).
OPEN_PATHS = ("/health", "/")
# Passed without a key, as vLLM and llama.cpp do: a browser's CORS preflight carries none (the
# CORS middleware, outside this one, answers it when --cors-origin is set); no route answers
# OPTIONS otherwise (405).
OPEN_METHODS = ("OPTIONS",)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return json.dumps(body).encode()


async def _reply(send, status: int, message: str, kind: str, headers=()) -> None:
    data = error_body(status, message, kind)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + list(headers)})
    await send({"type": "http.response.body", "body": data})


class Guard:
    def __init__(
        self,
        app,
        api_key: str | None = None,
        max_body_bytes: int = 1 << 20,
        max_headers: int = 256,
    ):
        self.app, self.api_key, self.limit = app, api_key, max_body_bytes
        self.max_headers = max_headers

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"")
        want = f"Bearer {self.api_key}".encode()
        return hmac.compare_digest(given, want)  # constant time: no key guessing by timing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if len(scope["headers"]) > self.max_headers:  # h11 caps their bytes (16 KiB), not count
            n = len(scope["headers"])
            why = f"the request has {n} headers; at most {self.max_headers} are accepted"
            return await _reply(send, 431, why, "invalid_request_error")
        headers = dict(scope["headers"])
        guarded = scope["path"] not in OPEN_PATHS and scope["method"] not in OPEN_METHODS
        if self.api_key and guarded and not self._authorized(headers):
            challenge = [(b"www-authenticate", b"Bearer")]
            return await _reply(
                send,
                401,
                "missing or wrong API key: send Authorization: Bearer KEY",
                "authentication_error",
                challenge,
            )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _reply(send, 413, self._too_big(), "invalid_request_error")
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) > self.limit:
                    return await _reply(send, 413, self._too_big(), "invalid_request_error")
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)

    def _too_big(self) -> str:
        return f"the request body is over the limit of {self.limit} bytes"


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: disconnects still arrive

    return replay
