"""The Responses API's wire format (POST /v1/responses): the request, read into the chat
request it is served as (serve/responses.py), and the Response object and its output message
as the official client reads them (openai-python's types/responses/response.py).

Stateless: the server keeps no responses and no conversations. `store` is accepted and ignored
(the API's default is true and clients send it without meaning to fetch anything back; each
Response says `"store": false`); `previous_response_id` and `conversation` are refused, since
there is nothing to continue from: send the whole conversation as `input`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator
from pydantic_core import PydanticCustomError

from doel.serve.protocol import MAX_SALT_CHARS, MAX_TOKENS, Request, unicode_text
from doel.serve.protocol_chat import MAX_MESSAGES, few_messages
from doel.serve.refusal import RequestError
from doel.serve.tenants import ONE

STATELESS = (
    "this server keeps no responses or conversations (it is stateless); send the whole "
    "conversation as input instead"
)


def text_parts(content):
    """Content as a string or a list of input_text/output_text parts; another kind (an image,
    a file) is refused by name."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("input_text", "output_text"):
                raise PydanticCustomError(
                    "content_part",
                    "content part {i} is of type '{kind}'; this model reads text only: send a "
                    "string or parts of type 'input_text'",
                    {"i": i, "kind": str(kind)[:40]},
                )
    return content


class TextPart(Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text part sent back carries these
    logprobs: list | None = None

    _unicode = field_validator("text")(unicode_text)


class InputMessage(Request):
    """One message of `input`; an earlier Response's output message sent back fits too."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("content", mode="before")(text_parts)
    _unicode = field_validator("content")(unicode_text)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def messages_only(items):
    """`input` items of type message (the default); a function call, its output or an item
    reference are refused by name (tools are served on /v1/chat/completions)."""
    if isinstance(items, list):
        few_messages(items)
        for i, item in enumerate(items):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind != "message":
                raise PydanticCustomError(
                    "input_item",
                    "input item {i} is of type '{kind}'; this server reads messages only "
                    "(function calls are served on /v1/chat/completions)",
                    {"i": i, "kind": str(kind)[:40]},
                )
    return items


class TextFormat(Request):
    """`text.format`: plain text, any JSON object, or a JSON schema's document (enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class ResponsesRequest(Request):
    """POST /v1/responses: the fields of OpenAI's that a stateless text model can honour."""

    model: str | None = None
    input: str | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = Field(None, description="accepted and ignored: nothing is stored")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    tools: list[dict] | None = Field(None, max_length=0, description="none: use chat")
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(None, max_length=0)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    _cache: Hashable | None = PrivateAttr(ONE)

    _messages = field_validator("input", mode="before")(messages_only)
    _unicode = field_validator("input", "instructions")(unicode_text)

    @property
    def cache(self) -> Hashable | None:
        return self._cache

    @cache.setter
    def cache(self, value: Hashable | None) -> None:
        self._cache = value

    def refuse_state(self) -> None:
        """A 400 for what needs a server that remembers."""
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise RequestError(400, f"{name} is not supported: {STATELESS}", name)

    def messages(self) -> list[dict]:
        """The conversation as chat messages: instructions as the system message first."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*head, {"role": "user", "content": self.input}]
        role = {"developer": "system"}
        return head + [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.input]

    def format_spec(self) -> dict | None:
        """text.format as serve/structured.py compiles it (the flat shape); None: text."""
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return fmt.model_dump(by_alias=True, exclude_none=True)

    def echo(self) -> dict:
        """The request's settings as a Response repeats them."""
        spec = self.format_spec() or {"type": "text"}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "text": {"format": spec},
            "metadata": self.metadata or {},
            "user": self.user,
            "tools": [],
            "tool_choice": self.tool_choice or "auto",
            "parallel_tool_calls": True
            if self.parallel_tool_calls is None
            else self.parallel_tool_calls,
            "truncation": "disabled",
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "background": False,
        }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, parts: list[dict]) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": parts,
    }


def usage(prompt: int, made: int, cached: int) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + made,
    }
