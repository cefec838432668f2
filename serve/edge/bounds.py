"""What one request may make the server hold and compile, bounded per request: how many tools it
offers, how large one tool's parameters schema is, and how many items the Responses API's input
holds and how many bytes of text they carry.

Each bound is a `Settings` field with its flag (`--max-tools`...), as `--max-messages` is: the
app's ModelContext puts the server's Settings in `LIMITS` for each request, and the body's
validation reads it, so that a request past a bound is refused in one line naming the flag (a
400 whose `param` is the field), before anything is rendered, tokenized or compiled. The grammar
engine's own limits and the compile's time bound are `structured`'s.
"""

from __future__ import annotations

import json
from contextvars import ContextVar

from pydantic_core import PydanticCustomError

from doel.serve.settings import Settings

# The served Settings, set by the app for each request; outside one (a test building a request
# by hand), DEFAULTS.
LIMITS: ContextVar[Settings | None] = ContextVar("doel_limits", default=None)
DEFAULTS = Settings(bundle="")


def limits() -> Settings:
    """The bounds of the request being served."""
    return LIMITS.get() or DEFAULTS


def few_tools(tools):
    """At most --max-tools tools, counted before any is validated."""
    if isinstance(tools, list) and len(tools) > (limit := limits().max_tools):
        raise PydanticCustomError(
            "too_many_tools",
            "{n} tools, over this server's limit of {limit} (--max-tools); send fewer",
            {"n": len(tools), "limit": limit},
        )
    return tools


def small_schema(schema):
    """A tool's parameters schema of at most --max-tool-schema-bytes, as compact JSON."""
    if schema is None:
        return schema
    limit = limits().max_tool_schema_bytes
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode())
    if size > limit:
        raise PydanticCustomError(
            "tool_schema_size",
            "the parameters schema is {n:,} bytes, over this server's limit of {limit:,} "
            "(--max-tool-schema-bytes); shorten it",
            {"n": size, "limit": limit},
        )
    return schema


def few_items(items):
    """At most --max-input-items items in the Responses API's input, counted before any is
    validated."""
    if isinstance(items, list) and len(items) > (limit := limits().max_input_items):
        raise PydanticCustomError(
            "too_many_items",
            "{n} input items, over this server's limit of {limit} (--max-input-items); send fewer",
            {"n": len(items), "limit": limit},
        )
    return items


def small_input(texts) -> None:
    """The texts of the Responses API's input, at most --max-input-bytes in UTF-8 together."""
    limit, size = limits().max_input_bytes, 0
    for text in texts:
        size += len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PydanticCustomError(
                "input_size",
                "the input's texts are over {limit:,} bytes, this server's limit "
                "(--max-input-bytes); send a shorter conversation",
                {"limit": limit},
            )
