"""A request body that is not JSON, said in words: what is wrong and where (line, column).

FastAPI reports a malformed body as `{"loc": ["body", 17], "msg": "JSON decode error"}`, which
the validation message turned into "17: JSON decode error" with the param "17"; a body that is
not UTF-8, or nests past the parser's depth, was only "There was an error parsing the body".
These read the position FastAPI (the JSON decoder) reports against the body's text, or the
bytes the UTF-8 decoder stopped at, and answer as JSON decoders say it: "JSON decode error at
line 3, column 5: Expecting ',' delimiter".
"""

from __future__ import annotations

PREFIX = "JSON decode error"


def _place(text: str, pos: int) -> str:
    """'line L, column C' of character `pos` in `text`, both from 1, as json's own errors."""
    line = text.count("\n", 0, pos) + 1
    return f"line {line}, column {pos - text.rfind(chr(10), 0, pos)}"


def decode_error(errors: list[dict], body) -> str | None:
    """The message for a RequestValidationError whose one error is FastAPI's `json_invalid`
    (`errors` and `body` are the exception's), or None for any other refusal."""
    if len(errors) != 1 or errors[0].get("type") != "json_invalid":
        return None
    e = errors[0]
    why = (e.get("ctx") or {}).get("error") or "not valid JSON"
    pos = e.get("loc", (None,))[-1]
    if not isinstance(body, str) or not isinstance(pos, int) or not 0 <= pos <= len(body):
        return f"{PREFIX}: {why}"
    # The decoder stops at the end of a body cut short ("Expecting value", "Unterminated
    # string"): that is the likelier fault than the grammar it names.
    end = "; the body ends there: was it cut short?" if pos == len(body) else ""
    return f"{PREFIX} at {_place(body, pos)}: {why}{end}"


def parse_failure(cause: BaseException | None) -> str | None:
    """The message for FastAPI's "There was an error parsing the body" (an HTTPException) from
    its cause, when that is one a client can fix; None otherwise."""
    if isinstance(cause, UnicodeDecodeError):
        data, start = cause.object, cause.start
        # Valid up to the bad byte: its characters give the line and column.
        head = bytes(data[:start]).decode(cause.encoding, "replace")
        where = _place(head, len(head))
        byte = f"byte 0x{data[start]:02x}" if start < len(data) else "the last bytes"
        name = "UTF-8" if cause.encoding.startswith("utf-8") else cause.encoding.upper()
        return f"{PREFIX} at {where}: the body is not {name} ({byte}: {cause.reason}); send UTF-8"
    if isinstance(cause, RecursionError):
        return f"{PREFIX}: the body nests arrays or objects deeper than the parser goes"
    return None
