"""RequestError: a request the server refuses, with its HTTP status, message and parameter.

Its own module so that serve/service.py and the modules it builds on (serve/structured.py)
raise the same class; serve/app.py answers it in OpenAI's error shape.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = {"Retry-After": "1"} if status == 429 else None
