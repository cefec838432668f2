"""The OpenAI error shape, built in one place: every refusal of doel-serve's, from a route, from
the middleware in front of the app, or written to a socket before any request was parsed.
"""

from __future__ import annotations

import json


def _text(value: str) -> str:
    # A message can quote what the client sent (a field's name), lone surrogates included,
    # which would not encode: they are written as escapes.
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def error_dict(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI's API answers."""
    return {
        "error": {
            "message": _text(message),
            "type": kind,
            "param": None if param is None else _text(param),
            "code": status,
        }
    }


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """The same as JSON bytes, for a response written without a framework."""
    return json.dumps(error_dict(status, message, kind, param)).encode()
