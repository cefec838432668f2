"""The wire format: OpenAI-compatible request models whose bounds are declared on the fields (a
bad value is refused with its name before any work), and `to_sampling_params`, the one place
where a request becomes the engine's parameters. The chat endpoint's models build on these.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from contextvars import ContextVar
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from doel.serve.core.logprobs import MAX_TOP
from doel.serve.core.sampling import MIN_REPETITION_PENALTY, SamplingParams
from doel.serve.edge.tenants import ONE

MAX_TOKENS = 1 << 20  # a bound for the schema; the context length is checked per request
MAX_STOPS = 4  # as OpenAI
# Characters in one stop string: enough for any real delimiter, and it bounds the text a
# stream holds back and searches for each token.
MAX_STOP_CHARS = 256
INT64_MAX = (1 << 63) - 1
MAX_ERRORS_SHOWN = 5  # a refusal lists this many problems, then counts the rest
MAX_SALT_CHARS = 1024  # a cache_salt: room for any token a client derives it from
# Prompts in one request (each one choice): a scorer batches (lm-eval's batch_size), and each
# prompt's logits and KV cache are the server's, so the batch is bounded as the body is.
MAX_PROMPTS = 64
# Token ids in one list: the serving model's context, set by the app for each request. It is
# checked before the items, so that a long list of bad ids is one error, not one each (whose
# building and answer would grow with the list the client chose to send).
CONTEXT_LENGTH: ContextVar[int] = ContextVar("doel_context_length", default=MAX_TOKENS)


def within_context(ids):
    """A list of token ids no longer than the context, checked before its items are."""
    if isinstance(ids, list) and len(ids) > (context := CONTEXT_LENGTH.get()):
        raise PydanticCustomError(
            "too_long",
            "{n} token ids, more than the model's context of {context}; send fewer",
            {"n": len(ids), "context": context},
        )
    return ids


def prompts_within_context(prompt):
    """A prompt, or a batch of prompts, each list of ids no longer than the context."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        for ids in prompt:
            within_context(ids)
        return prompt
    return within_context(prompt)


def of_kinds(items, kinds: tuple[str, ...], code: str, message: str):
    """`items` unchanged when each one's `type` is one of `kinds`; else the first other kind is
    refused by name (`message` fills in {i} and {kind}) before a union's validation would list
    one error for each of its arms. Anything but a list is left to the field's own type."""
    for i, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        if kind not in kinds:
            raise PydanticCustomError(code, message, {"i": i, "kind": str(kind)[:40]})
    return items


def unicode_text(value):
    """Text (or a list of texts) that is Unicode: JSON's \\ud800 escape without its pair parses
    into a lone surrogate, which no tokenizer or UTF-8 encoder takes."""
    for text in [value] if isinstance(value, str) else value or []:
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PydanticCustomError(
                "unicode",
                "a lone surrogate {code} at character {at} is not Unicode text; send valid UTF-8",
                {"code": text[e.start].encode("unicode_escape").decode(), "at": e.start},
            ) from None
    return value


class Request(BaseModel):
    # An unknown field is refused by name rather than silently ignored (a typo in `top_p`
    # would otherwise sample with the default). Strict: "8" and true are not numbers, nor 1 a
    # boolean (pydantic's lax mode takes them); an integer is still a float.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data):
        # Many unknown fields are one error here rather than one each from `extra="forbid"`.
        fields = cls.model_fields  # a property: read once, not for each key
        if isinstance(data, dict) and len(data) > len(fields) + MAX_ERRORS_SHOWN:
            unknown = [k for k in data if k not in fields]
            names = ", ".join(repr(k[:40]) for k in unknown[:MAX_ERRORS_SHOWN])
            raise PydanticCustomError(
                "extra_forbidden",
                "{n} unknown fields ({names}, ...); remove them",
                {"n": len(unknown), "names": names},
            )
        return data


class StreamOptions(Request):
    include_usage: bool = False


class JsonSchemaFormat(Request):
    """response_format.json_schema, as OpenAI's: the schema is enforced whether or not
    `strict` is set (a small model follows none by itself)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    """OpenAI's response_format: plain text, any JSON object, or a JSON schema's document
    (enforced by constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "json_schema",
                "type 'json_schema' takes a json_schema object (and the other types none); "
                "send {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
            )
        return self


class Partitioned(Request):
    """A request served through the prefix cache: its partition (`tenants.partition`), set by
    the server from the key's tenant and the request's cache_salt (`answer.respond`); a request
    built in a test has the one of no key."""

    _cache: Hashable | None = PrivateAttr(ONE)

    @property
    def cache(self) -> Hashable | None:
        return self._cache

    @cache.setter
    def cache(self, value: Hashable | None) -> None:
        self._cache = value


class SamplingRequest(Partitioned):
    """The fields completions and chat share, and `to_sampling_params`, the one place where a
    request becomes the engine's parameters. Extensions beyond OpenAI's fields (as vLLM and
    llama.cpp name them): top_k, repetition_penalty."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1 << 20, description="0 or -1: off")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one completion per request")
    user: str | None = None
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="as vLLM: a prompt's cached prefix is reused only for requests with the "
        "same salt (and tenant)",
    )
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: the output is a document that parses"
    )

    _unicode_stop = field_validator("stop")(unicode_text)

    def format_spec(self) -> dict | None:
        """response_format as the dict `Grammars` compiles; None: plain text."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        return rf.model_dump(by_alias=True, exclude_none=True)

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, stop: str | list[str] | None):
        for s in [stop] if isinstance(stop, str) else stop or []:
            if len(s) > MAX_STOP_CHARS:
                raise PydanticCustomError(
                    "stop_too_long",
                    "a stop string is {n} characters, over the limit of {limit}; shorten it",
                    {"n": len(s), "limit": MAX_STOP_CHARS},
                )
        return stop

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        """The engine's parameters; `max_tokens` is the request's, already fitted to the
        context by the caller, and `stop_ids` the ids that end it (EOS; chat adds <|end|>)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop_token_ids=stop_ids,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(
        description="text, or token ids (the BOS id is not added), or a list of either: one "
        "choice each"
    )
    max_tokens: int = Field(16, ge=0, le=MAX_TOKENS, description="0: only score (with echo)")
    best_of: int | None = Field(None, ge=1, le=1)
    echo: bool = Field(False, description="the prompt goes in front of the completion")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP, description="top log-probabilities")

    _prompt_within_context = field_validator("prompt", mode="before")(prompts_within_context)
    _unicode = field_validator("prompt")(unicode_text)

    @model_validator(mode="after")
    def _scoring(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError(
                "no_tokens", "max_tokens is 0 without echo, which returns nothing; set echo"
            )
        if self.stream and (self.echo or self.logprobs is not None or len(self.prompts()) > 1):
            raise PydanticCustomError(
                "stream_scoring",
                "stream takes one prompt without echo or logprobs; set stream to false",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt (text or ids) per choice."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class TokenizeRequest(Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

    _unicode = field_validator("prompt")(unicode_text)


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[int]

    _tokens_within_context = field_validator("tokens", mode="before")(within_context)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV entries a slot already held (prefix cache)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, made: int, cached: int = 0) -> Usage:
        details = PromptTokensDetails(cached_tokens=cached)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=made,
            total_tokens=prompt + made,
            prompt_tokens_details=details,
        )


class Logprobs(BaseModel):
    """OpenAI's legacy completions shape: one entry per token (the prompt's first with echo,
    whose log-probability is null, having no context)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class Choice(BaseModel):
    text: str
    index: int = 0
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Envelope(BaseModel):
    """What a whole answer and each chunk of a streamed one start with (`answer.envelope`
    builds it); a subclass narrows `object` to its own."""

    id: str
    object: str
    created: int
    model: str


class Completion(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "doel"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


def sse(obj) -> str:
    """One server-sent event of a streamed answer (completions and chat alike)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
