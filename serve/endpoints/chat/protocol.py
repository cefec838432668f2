"""The chat wire format: POST /v1/chat/completions' request (messages, OpenAI's content
parts of which only text is read; tools, tool_choice, assistant tool_calls and tool messages)
and its whole answer (streamed chunks are built as plain dicts by the chat route, on the hot
path). The fields shared with completions, their bounds and `to_sampling_params` are
`SamplingRequest`'s; what tools do to a request is `tools.plan`'s.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Annotated, Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from doel.serve.core.logprobs import MAX_TOP
from doel.serve.edge.bounds import few_tools, small_schema
from doel.serve.endpoints.protocol import (
    MAX_TOKENS,
    Envelope,
    Request,
    SamplingRequest,
    Usage,
    of_kinds,
    unicode_text,
)
from doel.serve.settings import Settings

# Messages in one chat request: each renders to 2 tokens at least (its role and end markers),
# so more than this cannot fit any context a doel model has. The schema's bound; the server's
# own (`--max-messages`, set by the app for each request) is lower.
MAX_MESSAGES = 1 << 12
MESSAGE_LIMIT: ContextVar[int] = ContextVar("doel_message_limit", default=Settings.max_messages)
MAX_TOOLS = 128  # as OpenAI; the schema's bound, the server's is --max-tools
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # as OpenAI: a name that needs no quoting anywhere
MAX_ID_CHARS = 256


def few_messages(messages):
    """At most the server's limit of messages, refused by count before any is validated (a
    flood of tiny messages costs the event loop its validation, and a thread its rendering)."""
    if isinstance(messages, list) and len(messages) > (limit := MESSAGE_LIMIT.get()):
        raise PydanticCustomError(
            "too_many_messages",
            "{n} messages, over this server's limit of {limit} (--max-messages); send fewer",
            {"n": len(messages), "limit": limit},
        )
    return messages


def text_parts_only(content):
    """Message content as a string or OpenAI's list of parts, of which this model reads only
    the text ones: another kind (an image, audio) is refused by name."""
    return of_kinds(
        content,
        ("text",),
        "content_part",
        "content part {i} is of type '{kind}'; this model reads text only: send a string or "
        "parts of type 'text'",
    )


class TextPart(Request):
    type: Literal["text"]
    text: str

    _unicode = field_validator("text")(unicode_text)


class FunctionCall(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="a JSON object, as text")


class ToolCall(Request):
    """An assistant's call in the conversation sent back."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Request):
    """One turn. `name` is accepted (clients send it) and not shown to the model: the
    template has no place for it. An assistant's `tool_calls` (its content may then be null)
    are answered by `tool` messages naming the call's id."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)

    _parts = field_validator("content", mode="before")(text_parts_only)
    _unicode = field_validator("content")(unicode_text)

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "no_content", "a {role} message needs content", {"role": self.role}
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError(
                "tool_call_id",
                "a tool message, and only one, names the call it answers in tool_call_id",
            )
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="the arguments are constrained either way")

    _unicode = field_validator("description")(unicode_text)
    _small = field_validator("parameters")(small_schema)


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Request):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The reply ends at the end-of-turn token or EOS."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="default: the rest")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="accepted; a constrained reply (required, named) is one call"
    )

    # The tools' plan of this request, made once: pieces, stream and whole all read it
    _tool_plan: object = PrivateAttr(None)

    _few_messages = field_validator("messages", mode="before")(few_messages)
    _few_tools = field_validator("tools", mode="before")(few_tools)

    @model_validator(mode="after")
    def _one_limit(self):
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise PydanticCustomError(
                "two_limits",
                "max_tokens ({a}) and max_completion_tokens ({b}) differ; send one of them",
                {"a": both[0], "b": both[1]},
            )
        if self.logprobs or self.top_logprobs:
            raise PydanticCustomError(
                "chat_logprobs",
                "log-probabilities are served by /v1/completions only; unset logprobs",
            )
        return self

    def limit(self) -> int | None:
        """The most tokens asked for; None: up to the context's end."""
        return self.max_completion_tokens or self.max_tokens

    def turns(self) -> list[dict]:
        """The messages as the chat template reads them: role and content (text), an
        assistant's tool_calls with their arguments as objects, a tool's tool_call_id. A
        RequestError-worthy problem (arguments that are no JSON object, a tool message that
        answers no call) is raised as ValueError with the parameter's path."""
        out, open_ids = [], set()
        for i, m in enumerate(self.messages):
            turn = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                turn["tool_calls"] = [
                    _call_dict(c, f"messages[{i}].tool_calls[{j}]")
                    for j, c in enumerate(m.tool_calls)
                ]
                open_ids = {c.id for c in m.tool_calls}
            elif m.role == "tool":
                if m.tool_call_id not in open_ids:
                    raise ValueError(
                        f"messages[{i}]: a tool message answers tool_call_id "
                        f"{m.tool_call_id[:80]!r}, which the assistant message before it "
                        "did not call; send tool messages right after the assistant's tool_calls"
                    )
                turn["tool_call_id"] = m.tool_call_id
            else:
                open_ids = set()
            out.append(turn)
        return out


def _call_dict(c: ToolCall, where: str) -> dict:
    try:
        args = json.loads(c.function.arguments)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise ValueError(
            f"{where}.function.arguments is not a JSON object; send its arguments as "
            'the text of one, e.g. "{}"'
        )
    return {
        "id": c.id,
        "type": "function",
        "function": {"name": c.function.name, "arguments": args},
    }


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
