"""Tool calls on /v1/chat/completions: the request's `tools` and `tool_choice` turned into what
the prompt shows, what the reply is constrained to, and how the reply is read back.

The format is the chat template's (doel's CHAT_TEMPLATE, train/data/tokenizer.py): the tools in
the system turn, a call written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

- `auto`: the tools are shown and the reply is free; a `<tool_call>` block whose JSON names a
  given function with an object of arguments becomes a tool call, anything else stays text.
- `required` and a named function: the reply is made to start with `<tool_call>` (in the
  prompt's ids) and is constrained to the call's JSON: with one function
  possible, its arguments only (the prompt ends `{"name": "f", "arguments": `, so the name is
  the model's to read, not to guess); with several, `{"name": ..., "arguments": ...}` for one
  of them, in that order (a grammar: a JSON schema's engine may order the keys its own way,
  and the template, the training data and a stream that names the function first need it).
  Arguments therefore always parse, except under finish_reason "length".
- `none`: the tools are not shown (a small model that sees them calls them) and the reply is
  text.

`Deltas` turns a reply's text into chat deltas as OpenAI streams them (content, or per call its
index, id and name first, then fragments of the arguments); a whole answer is those deltas
assembled, so both shapes say the same.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from doel.serve.core.structured import JSON_OPTIONS
from doel.serve.edge.refusal import RequestError

CALL, CALL_END = "<tool_call>", "</tool_call>"  # the template's spelling of a call
# The call's head as the constrained JSON writes it (", " and ": " separators).
HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass
class ToolPlan:
    """What a request's tools do to its prompt, its constraint and the reading of its reply."""

    mode: str = "text"  # text | auto | named | required
    tools: list[dict] | None = None  # shown in the prompt
    names: set[str] = field(default_factory=set)
    prefix: str = ""  # the reply's forced start, in the prompt
    schema: dict | None = None  # the constraint on the reply: a JSON schema
    grammar: str | None = None  # or a grammar (llguidance's Lark)
    name: str | None = None  # named: the function called
    param: str = "tools"  # where a schema the engine refuses came from
    # required, several tools: each tool's arguments schema and its parameter, compiled alone
    # first, so one that admits no document is refused by name (the grammar of all of them
    # would still admit the others' calls)
    each: tuple[tuple[str, dict], ...] = ()


def plan(req) -> ToolPlan:
    """The request's ToolPlan, or a 400 naming the parameter that is wrong; made once a
    request (the prompt, the stream and the whole answer all read it)."""
    if req._tool_plan is None:
        req._tool_plan = _plan(req)
    return req._tool_plan


def _plan(req) -> ToolPlan:
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise RequestError(
                400,
                "tool_choice is set but tools is not; send the tools to choose from",
                "tool_choice",
            )
        return ToolPlan()
    defs = [t.function for t in tools]
    names = [f.name for f in defs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RequestError(400, f"tools name the function {twice[0]!r} twice; rename one", "tools")
    for i, f in enumerate(defs):
        kind = (f.parameters or {}).get("type", "object")
        if kind != "object":
            raise RequestError(
                400,
                f"tools[{i}].function.parameters is a schema of type {str(kind)[:40]!r}; a "
                "function's arguments are an object: give a schema of type 'object'",
                f"tools[{i}].function.parameters",
            )
    if choice == "none":
        return ToolPlan()
    if req.format_spec() is not None:
        raise RequestError(
            400,
            "response_format cannot be combined with tools (the reply is a tool call or "
            "text); unset one, or set tool_choice to 'none'",
            "response_format",
        )
    shown = [t.model_dump(exclude_none=True) for t in tools]
    if choice in (None, "auto"):
        return ToolPlan("auto", shown, set(names))
    if choice == "required" and len(defs) > 1:
        each = tuple(
            (f"tools[{i}].function.parameters", _parameters(f)) for i, f in enumerate(defs)
        )
        return ToolPlan(
            "required", shown, set(names), CALL, grammar=_calls_grammar(defs), each=each
        )
    name = defs[0].name if choice == "required" else choice.function.name
    if name not in names:
        raise RequestError(
            400,
            f"tool_choice names the function {name!r}, which tools does not define "
            f"(it defines {', '.join(map(repr, names))})",
            "tool_choice",
        )
    i = names.index(name)
    head = CALL + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    param = f"tools[{i}].function.parameters"
    schema = _parameters(defs[i])
    return ToolPlan("named", shown, set(names), head, schema, name=name, param=param)


def _parameters(f) -> dict:
    """A function's arguments schema; none declared: an object (OpenAI's reading)."""
    return f.parameters if f.parameters is not None else {"type": "object"}


def _calls_grammar(defs) -> str:
    """One call of any of the functions, name first: {"name": "f", "arguments": ARGS}."""
    rules = ["start: " + " | ".join(f"call{i}" for i in range(len(defs)))]
    for i, f in enumerate(defs):
        head = json.dumps('{"name": ' + json.dumps(f.name) + ', "arguments": ')
        args = {**_parameters(f), "x-guidance": JSON_OPTIONS}
        rules += [f'call{i}: {head} args{i} "}}"', f"args{i}: %json {json.dumps(args)}"]
    return "\n".join(rules) + "\n"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON, or None: not JSON, not an object with
    a given function's name and an object of arguments."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return call["name"], json.dumps(args, ensure_ascii=False)


class Deltas:
    """A reply's text, pushed as it comes, as chat deltas (dicts for `delta`)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.calls, self.buf = plan, 0, ""
        self.inside = False  # auto: within a <tool_call> block
        self.args_from = None  # required: where the arguments start in buf

    def push(self, text: str) -> list[dict]:
        if not text:
            return []
        mode = self.plan.mode
        if mode == "text":
            return [{"content": text}]
        if mode == "named":
            head = [] if self.calls else self._head(self.plan.name)
            return [*head, self._args(text)]
        self.buf += text
        return self._required() if mode == "required" else self._auto()

    def end(self, reason: str) -> tuple[list[dict], str]:
        """The deltas still held back, and the finish reason ("tool_calls" for a reply that
        called and stopped)."""
        mode, out = self.plan.mode, []
        if mode == "named" and not self.calls:
            out = self._head(self.plan.name)  # a reply of no text (cut at once)
        elif mode == "required" and self.args_from is not None:
            rest = self.buf[self.args_from :]
            rest = rest[:-1] if reason == "stop" and rest.endswith("}") else rest
            out = [self._args(rest)] if rest else []
        elif mode == "auto":
            out = self._auto_end()
        if self.calls and reason == "stop":
            reason = "tool_calls"
        return out, reason

    def _head(self, name: str) -> list[dict]:
        index, self.calls = self.calls, self.calls + 1
        function = {"name": name, "arguments": ""}
        return [
            {
                "tool_calls": [
                    {"index": index, "id": call_id(), "type": "function", "function": function}
                ]
            }
        ]

    def _args(self, fragment: str) -> dict:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": fragment}}]}

    def _required(self) -> list[dict]:
        out = []
        if self.args_from is None:
            m = HEAD.match(self.buf)
            if m is None:
                return []
            out, self.args_from = self._head(json.loads(m.group(1))), m.end()
        # The last character may be the call's closing brace: held until more comes.
        ready = self.buf[self.args_from : -1]
        if ready:
            out.append(self._args(ready))
            self.args_from += len(ready)
        return out

    def _auto(self) -> list[dict]:
        out = []
        while True:
            if self.inside:
                end = self.buf.find(CALL_END)
                if end < 0:
                    return out
                out += self._block(self.buf[:end], CALL + self.buf[: end + len(CALL_END)])
                self.buf, self.inside = self.buf[end + len(CALL_END) :], False
                continue
            start = self.buf.find(CALL)
            if start < 0:
                keep = _partial(self.buf, CALL)  # a suffix that may begin a call
                text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return out + ([{"content": text}] if text else [])
            if start:
                out.append({"content": self.buf[:start]})
            self.buf, self.inside = self.buf[start + len(CALL) :], True

    def _block(self, body: str, raw: str) -> list[dict]:
        read = read_call(body, self.plan.names)
        if read is None:
            return [{"content": raw}]  # not a call: the text as written
        return [*self._head(read[0]), self._args(read[1])]

    def _auto_end(self) -> list[dict]:
        rest, self.buf = self.buf, ""
        if self.inside:  # a block the reply left open: a call if its JSON is whole
            return self._block(rest, CALL + rest) if rest.strip() else [{"content": CALL}]
        return [{"content": rest}] if rest else []


def _partial(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def assemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """A whole message from its deltas: (content or None, tool calls as OpenAI's)."""
    content, calls = [], []
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for c in d.get("tool_calls", ()):
            if "id" in c:
                calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    text = "".join(content)
    return (text if text or not calls else None), calls
