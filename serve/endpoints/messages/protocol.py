"""Anthropic's Messages API wire format (POST /v1/messages and /v1/messages/count_tokens): the
request, read into the chat request it is served as (`MessagesRequest.chat_body`: `system` as
the system message, text blocks as content, `tool_use` blocks as an assistant's tool_calls,
`tool_result` blocks as tool messages, `tools` and `tool_choice` as chat's), and the pieces of
the Message object as the official client reads them (anthropic-python's types/message.py).

Text only: an `image` or `document` block (or any other kind) is refused by name, in a 400.
`cache_control` on a block or tool is accepted and ignored: doel's prefix cache reuses a
conversation's prefix by itself
(docs/serving.md#sharing-a-server-tenants-and-the-prefix-cache). `max_tokens` is required, as
Anthropic requires it. A conversation that ends with the assistant's text is continued from
that text (Anthropic's prefill).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator
from pydantic_core import PydanticCustomError

from doel.serve.edge.bounds import few_tools, small_schema
from doel.serve.endpoints.chat.protocol import (
    FUNCTION_NAME,
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
    few_messages,
)
from doel.serve.endpoints.protocol import (
    INT64_MAX,
    MAX_STOPS,
    MAX_TOKENS,
    Partitioned,
    Request,
    of_kinds,
    unicode_text,
)

BLOCKS = ("text", "tool_use", "tool_result")


def known_blocks(content):
    """Content as a string or a list of text, tool_use and tool_result blocks; another kind
    (image, document, thinking...) is refused by name."""
    return of_kinds(
        content,
        BLOCKS,
        "content_block",
        "content block {i} is of type '{kind}'; this model reads text only: send a string or "
        "blocks of type 'text' (and 'tool_use' / 'tool_result' for tools)",
    )


class CacheControl(Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = Field(None, max_length=0)

    _unicode = field_validator("text")(unicode_text)


def text_blocks(content):
    return of_kinds(
        content,
        ("text",),
        "content_block",
        "block {i} is of type '{kind}'; only 'text' blocks are read here",
    )


class ToolUseBlock(Request):
    """An assistant's earlier call, sent back."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(Request):
    """A call's result, in the user turn that follows it."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    _blocks = field_validator("content", mode="before")(text_blocks)
    _unicode = field_validator("content")(unicode_text)

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined(self.content)
        return f"error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _joined(blocks) -> str:
    return "".join(b.text for b in blocks if b.type == "text")


class Message(Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    _blocks = field_validator("content", mode="before")(known_blocks)
    _unicode = field_validator("content")(unicode_text)

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(Request):
    """A client tool: its name, description and the JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict
    cache_control: CacheControl | None = None

    _small = field_validator("input_schema")(small_schema)
    _unicode = field_validator("description")(unicode_text)

    def as_chat(self) -> dict:
        fn = {"name": self.name, "parameters": self.input_schema}
        return {"type": "function", "function": fn | _given(description=self.description)}


def client_tools(tools):
    """Client tools only: a server tool (web_search, code_execution...) is refused by name."""
    if isinstance(tools, list):
        for i, t in enumerate(tools):
            kind = t.get("type", "custom") if isinstance(t, dict) else "custom"
            if kind != "custom":
                raise PydanticCustomError(
                    "tool_type",
                    "tools[{i}] is of type '{kind}'; this server runs no server tools: give "
                    "client tools (a name and an input_schema) and run them yourself",
                    {"i": i, "kind": str(kind)[:40]},
                )
    return tools


class ToolChoice(Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    disable_parallel_tool_use: bool | None = Field(None, description="one call a reply anyway")

    def as_chat(self) -> str | dict:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError(
                "tool_choice: type 'tool', and only it, names the tool: "
                "{'type': 'tool', 'name': ...}"
            )
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Metadata(Request):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(Partitioned):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None

    _few_messages = field_validator("messages", mode="before")(few_messages)
    _tools = field_validator("tools", mode="before")(client_tools)
    _few_tools = field_validator("tools", mode="before")(few_tools)
    _system = field_validator("system", mode="before")(text_blocks)
    _unicode = field_validator("system")(unicode_text)

    @property
    def cache_salt(self) -> None:
        return None  # `answer.respond` reads it: the key's tenant is the partition

    def prefill(self) -> str:
        """The text of a last assistant message (it holds only text): the reply goes on from
        it. "" when the conversation ends with the user's turn."""
        last = self.messages[-1]
        if last.role != "assistant" or any(b.type != "text" for b in last.blocks()):
            return ""
        return _joined(last.blocks())

    def chat_body(self) -> dict:
        """The chat request's messages, tools and tool_choice; a ValueError names what does not
        map (its message starts with the parameter's path)."""
        shown = self.messages[:-1] if self.prefill() else self.messages
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _joined(self.system)
            out.append({"role": "system", "content": system})
        for i, m in enumerate(shown):
            out += _chat_messages(m, f"messages[{i}]")
        body = {"messages": out}
        if self.tools:
            body["tools"] = [t.as_chat() for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.as_chat()
        return body


def _chat_messages(m: Message, where: str) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results first, as tool
    messages (they answer the assistant turn before it), then its text; an assistant turn's
    text and its tool_use blocks as one message with tool_calls."""
    blocks = m.blocks()
    text = _joined(blocks)
    if m.role == "assistant":
        if any(b.type == "tool_result" for b in blocks):
            raise ValueError(f"{where}: tool_result blocks belong in a user message")
        calls = [_call(b) for b in blocks if b.type == "tool_use"]
        return [{"role": "assistant", "content": text or None} | _given(tool_calls=calls or None)]
    if any(b.type == "tool_use" for b in blocks):
        raise ValueError(f"{where}: tool_use blocks belong in an assistant message")
    out = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
        for b in blocks
        if b.type == "tool_result"
    ]
    has_text = any(b.type == "text" for b in blocks)
    return out + ([{"role": "user", "content": text}] if has_text or not out else [])


def _call(b: ToolUseBlock) -> dict:
    arguments = json.dumps(b.input, ensure_ascii=False)
    return {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}}


def _given(**fields) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages: the fields of Anthropic's that a text model served by doel honours
    (temperature is Anthropic's 0 to 1; the 2.x client sends temperature, top_p, top_k and doel's
    seed as extra_body)."""

    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description="doel's, as the chat route's")
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="ignored")
    thinking: dict | None = Field(None, description="ignored: the model does not think")
    cache_control: CacheControl | None = Field(None, description="ignored: the cache is automatic")
    _chat: object = PrivateAttr(None)  # the chat request that serves it
    _prompt_tokens: int = PrivateAttr(0)  # a stream's, for message_start

    _unicode_stops = field_validator("stop_sequences")(unicode_text)

    def sampling(self) -> dict:
        """The chat request's limit, stops and sampling fields."""
        out = {"max_tokens": self.max_tokens} | _given(
            stop=self.stop_sequences or None,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            user=self.metadata.user_id if self.metadata else None,
        )
        return out


def usage(prompt: int, made: int, cached: int) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache (the prefix cache's
    hits are cache_read_input_tokens), as the API counts them."""
    return {
        "input_tokens": prompt - cached,
        "output_tokens": made,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def message(mid: str, model: str, content: list[dict], reason, stop, use: dict) -> dict:
    """The Message object (a whole answer, or message_start's with no content yet)."""
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": use,
    }
