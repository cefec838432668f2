"""A refusal: `RequestError` (its HTTP status, message and parameter), raised by the service and
the modules it builds on, and the one way its OpenAI-shaped body (`error_body`) is written where
no framework writes it: `send_error` on a raw ASGI `send` (the middleware in front of the app),
`raw_error` as the whole response an h11 connection writes before any request was parsed.
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

from doel.contracts.errors import error_body

Headers = Iterable[tuple[bytes, bytes]]


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = {"Retry-After": "1"} if status == 429 else None


def error_response(
    status: int, message: str, kind: str, headers: Headers = (), param: str | None = None
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """An error's headers (JSON's, its length, then `headers`) and its body."""
    body = error_body(status, message, kind, param)
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return head + list(headers), body


async def send_error(send, status: int, message: str, kind: str, headers: Headers = ()) -> None:
    """The error as a whole response on an ASGI `send`."""
    head, body = error_response(status, message, kind, headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def raw_error(status: int, message: str, kind: str) -> bytes:
    """The error as the bytes of a whole HTTP/1.1 response that closes its connection: written
    past h11, which may have no request to answer yet."""
    head, body = error_response(status, message, kind, [(b"connection", b"close")])
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in head]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
