"""The Responses API's wire format (POST /v1/responses): the request, read into the chat
request it is served as (`responses.as_chat`: messages, and function tools, calls and their
outputs as chat's tools, tool_calls and tool messages), and the Response object and its output
items as the official client reads them (openai-python's types/responses/response.py).

Stateless: the server keeps no responses and no conversations. `store` is accepted and ignored
(the API's default is true and clients send it without meaning to fetch anything back; each
Response says `"store": false`); `previous_response_id` and `conversation` are refused, since
there is nothing to continue from: send the whole conversation as `input`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator
from pydantic_core import PydanticCustomError

from doel.serve.edge.bounds import few_items, few_tools, small_input, small_schema
from doel.serve.edge.refusal import RequestError
from doel.serve.endpoints.chat.protocol import (
    FUNCTION_NAME,
    MAX_ID_CHARS,
    MAX_MESSAGES,
    MAX_TOOLS,
)
from doel.serve.endpoints.protocol import (
    MAX_SALT_CHARS,
    MAX_TOKENS,
    Partitioned,
    Request,
    of_kinds,
    unicode_text,
)

STATELESS = (
    "this server keeps no responses or conversations (it is stateless); send the whole "
    "conversation as input instead"
)


def text_parts(content):
    """Content as a string or a list of input_text/output_text parts; another kind (an image,
    a file) is refused by name."""
    return of_kinds(
        content,
        ("input_text", "output_text"),
        "content_part",
        "content part {i} is of type '{kind}'; this model reads text only: send a string or "
        "parts of type 'input_text'",
    )


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


class FunctionCallItem(Request):
    """An earlier reply's call, sent back in `input`."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Request):
    """A call's result, sent back in `input`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str
    id: str | None = None
    status: str | None = None

    _unicode = field_validator("output")(unicode_text)


def _item_text(item) -> str:
    if item.type == "function_call":
        return item.arguments
    return item.output if item.type == "function_call_output" else item.text()


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")
]
ITEM_TYPES = ("message", "function_call", "function_call_output")


def known_items(items):
    """`input` items: a message (its type may be left out), a function call or its output;
    another type (an item reference, a reasoning item) is refused by name."""
    if not isinstance(items, list):
        return items
    few_items(items)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            kind = item.get("type", "message")
            if kind not in ITEM_TYPES:
                raise PydanticCustomError(
                    "input_item",
                    "input item {i} is of type '{kind}'; this server reads messages, "
                    "function_call and function_call_output items",
                    {"i": i, "kind": str(kind)[:40]},
                )
            item = item if "type" in item else {**item, "type": "message"}
        out.append(item)
    return out


class FunctionTool(Request):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    _small = field_validator("parameters")(small_schema)

    def as_chat(self) -> dict:
        keys = ("name", "description", "parameters", "strict")
        fields = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return {"type": "function", "function": fields}


def function_tools(tools):
    """Function tools only: a hosted tool (web_search, file_search...) is refused by name."""
    return of_kinds(
        tools,
        ("function",),
        "tool_type",
        "tools[{i}] is of type '{kind}'; this server runs no hosted tools: give functions "
        "(type 'function') and run them yourself",
    )


class NamedFunction(Request):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


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


class ResponsesRequest(Partitioned):
    """POST /v1/responses: the fields of OpenAI's that a stateless text model can honour."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
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
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(None, max_length=0)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)
    _chat: object = PrivateAttr(None)  # the chat request that serves it

    _items = field_validator("input", mode="before")(known_items)
    _functions = field_validator("tools", mode="before")(function_tools)
    _few_tools = field_validator("tools", mode="before")(few_tools)
    _unicode = field_validator("input", "instructions")(unicode_text)

    @field_validator("input")
    @classmethod
    def _small_input(cls, value):
        """The input's texts, at most --max-input-bytes together (`bounds.small_input`)."""
        small_input([value] if isinstance(value, str) else map(_item_text, value))
        return value

    def refuse_state(self) -> None:
        """A 400 for what needs a server that remembers."""
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise RequestError(400, f"{name} is not supported: {STATELESS}", name)

    def messages(self) -> list[dict]:
        """The conversation as chat messages: instructions as the system message first; a
        run of function calls as one assistant message's tool_calls (the message before them
        when it is the assistant's), each output as a tool message."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            if item.type == "function_call":
                call = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": call}
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    out.append(last := {"role": "assistant", "content": None})
                last.setdefault("tool_calls", []).append(call)
            elif item.type == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
        return out

    def chat_tools(self) -> dict:
        """tools and tool_choice as chat's fields."""
        out = {"tools": [t.as_chat() for t in self.tools]} if self.tools else {}
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        return out | ({"tool_choice": choice} if choice is not None else {})

    def format_spec(self) -> dict | None:
        """text.format as `Grammars` compiles it (the flat shape); None: text."""
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
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "tool_choice": _dumped(self.tool_choice) or "auto",
            "parallel_tool_calls": True
            if self.parallel_tool_calls is None
            else self.parallel_tool_calls,
            "truncation": "disabled",
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "background": False,
        }


def _dumped(value):
    return value.model_dump() if isinstance(value, Request) else value


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


def call_item(call: dict, status: str) -> dict:
    """A function_call output item from chat's tool call."""
    f = call["function"]
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": f["name"],
        "arguments": f["arguments"],
    }
