"""The chat wire format: POST /v1/chat/completions' request (messages, OpenAI's content
parts of which only text is read) and its whole answer (streamed chunks are built as plain
dicts in serve/chat.py, on the hot path). The fields shared with
completions, their bounds and `to_sampling_params` are serve/protocol.py's.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from doel.serve.limits import DEFAULT_MAX_MESSAGES
from doel.serve.logprobs import MAX_TOP
from doel.serve.protocol import (
    MAX_TOKENS,
    Envelope,
    Request,
    SamplingRequest,
    Usage,
    unicode_text,
)

# Messages in one chat request: each renders to 2 tokens at least (its role and end markers),
# so more than this cannot fit any context a doel model has. The schema's bound; the server's
# own (`--max-messages`, set by the app for each request) is lower.
MAX_MESSAGES = 1 << 12
MESSAGE_LIMIT: ContextVar[int] = ContextVar("doel_message_limit", default=DEFAULT_MAX_MESSAGES)


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
    the text ones: another kind (an image, audio) is refused by name before the union's
    validation would list one error for each of its arms."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise PydanticCustomError(
                    "content_part",
                    "content part {i} is of type '{kind}'; this model reads text only: send "
                    "a string or parts of type 'text'",
                    {"i": i, "kind": str(kind)[:40]},
                )
    return content


class TextPart(Request):
    type: Literal["text"]
    text: str

    _unicode = field_validator("text")(unicode_text)


class ChatMessage(Request):
    """One turn. `name` is accepted (clients send it) and not shown to the model: the
    template has no place for it."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    _parts = field_validator("content", mode="before")(text_parts_only)
    _unicode = field_validator("content")(unicode_text)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The reply ends at the end-of-turn token or EOS."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="default: the rest")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

    _few_messages = field_validator("messages", mode="before")(few_messages)

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

    def turns(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletion(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
