"""Conversations for chat fine-tuning (`doel-train sft`), read and checked: SFTConfig, the run's
settings for reading them, and one-line errors that name the file and line of a bad one.

Format: JSONL, one conversation a line, `{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}` (or a Parquet column / hub dataset of the same), read from the same
files, folders and `hf:NAME[:CONFIG]` sources as every other input (train/data/textio.py). Rows
of prompt-response sets (`inputs`/`targets`, `instruction`/`output`) become one exchange with
`prompt_field`/`response_field`. Order: an optional system message first, then user and
assistant in turn, starting with user and ending with assistant; no empty content.

Tool use: a row may carry `"tools"` (OpenAI's function definitions, or a JSON string of
them); an assistant message may carry `"tool_calls"` ([{"type": "function", "function":
{"name", "arguments"}}], arguments an object or a JSON string of one; its content may then be
empty), and each is answered by one or more `{"role": "tool", "content": "..."}` messages before
the assistant speaks again. Rendering them to ids and batches is `doel.train.data.chat`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from doel.train.common import DoelError
from doel.train.data.textio import Source
from doel.train.settings import TrainConfig

ROLES = ("system", "user", "assistant", "tool")
OVERLONG = ("truncate", "drop")
ORDER = (
    "an optional system message first, then user and assistant in turn, starting with user "
    "and ending with assistant; tool messages only right after an assistant's tool_calls"
)


class Conversation(list):
    """A conversation's checked messages, and the tools its system turn offers (None: none).
    A list, so that code that reads messages needs nothing else."""

    tools: list | None = None

    @classmethod
    def of(cls, messages: list[dict], tools: list | None) -> Conversation:
        conv = cls(messages)
        conv.tools = tools or None
        return conv


@dataclass(frozen=True)
class SFTConfig(TrainConfig):
    """A chat fine-tuning run: TrainConfig's settings (its [model] is replaced by the base
    checkpoint's config.json) and how conversations are read."""

    messages_field: str = "messages"
    prompt_field: str = ""  # with response_field: a row is one exchange (e.g. inputs/targets)
    response_field: str = ""
    keep_rows: str = ""  # FIELD=VALUE: only rows whose FIELD equals VALUE (rows without it stay)
    skip_malformed: bool = False  # count and skip a bad conversation instead of stopping
    overlong: str = "truncate"  # a conversation over seq_len + 1 tokens: truncate or drop
    max_conversations: int = 0  # read at most this many (0: all)
    holdout_every: int = 20  # every Nth conversation is held out for validation (0: none)

    def __post_init__(self):
        super().__post_init__()
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {self.overlong!r}")
        if bool(self.prompt_field) != bool(self.response_field):
            raise ValueError("prompt_field and response_field are set together (or neither)")
        if self.keep_rows and "=" not in self.keep_rows:
            raise ValueError(f"keep_rows must be FIELD=VALUE, got {self.keep_rows!r}")
        for name in ("max_conversations", "holdout_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")


# ------------------------------------------------------------------ checking


def check_messages(messages, where: str, tools=None) -> Conversation:
    """The conversation's messages (role and content; an assistant's tool_calls, arguments as
    objects), or a DoelError naming `where` and what is wrong."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else type(messages).__name__
        raise DoelError(f"{where}: messages must be a non-empty list of messages, got {got}")
    out = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not _calls(m)):
            raise DoelError(
                f'{where}: message {i} must be {{"role": ..., "content": ...}}, got {str(m)[:80]}'
            )
        role, content = m["role"], m.get("content") or ""
        if role not in ROLES:
            raise DoelError(f"{where}: message {i} has unknown role {role!r}; roles: {ROLES}")
        calls = _tool_calls(m, f"{where}: message {i}") if role == "assistant" else []
        if not isinstance(content, str) or not (content.strip() or calls):
            raise DoelError(f"{where}: message {i} ({role}) has empty content")
        expected = _expected(out, i)
        if role not in expected:
            raise DoelError(
                f"{where}: message {i} is {role!r} where {' or '.join(map(repr, expected))} "
                f"is expected ({ORDER})"
            )
        out.append({"role": role, "content": content} | ({"tool_calls": calls} if calls else {}))
    if out[-1]["role"] != "assistant":
        raise DoelError(
            f"{where}: the last message is {out[-1]['role']!r}, not 'assistant' ({ORDER})"
        )
    return Conversation.of(out, _tools(tools, where))


def _expected(before: list[dict], i: int) -> tuple[str, ...]:
    """The roles message `i` (1-based) may have after the messages `before` it."""
    if not before:
        return ("system", "user")
    last = before[-1]
    if last["role"] == "assistant":
        return ("tool",) if last.get("tool_calls") else ("user",)
    if last["role"] == "tool":
        return ("tool", "assistant")
    return ("user",) if last["role"] == "system" else ("assistant",)


def _calls(m) -> list:
    return m.get("tool_calls") or [] if isinstance(m, dict) else []


def _tool_calls(m: dict, where: str) -> list[dict]:
    """An assistant's tool calls as {"type": "function", "function": {"name", "arguments"}},
    arguments a JSON object (a JSON string of one is parsed)."""
    calls = _calls(m)
    if not isinstance(calls, list):
        raise DoelError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls, 1):
        f = call.get("function", call) if isinstance(call, dict) else None
        name = f.get("name") if isinstance(f, dict) else None
        args = f.get("arguments", {}) if isinstance(f, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            raise DoelError(
                f'{where}: tool call {j} must be {{"function": {{"name": "...", "arguments": '
                f"{{...}}}}}} (arguments a JSON object), got {str(call)[:80]}"
            )
        out.append({"type": "function", "function": {"name": name, "arguments": args}})
    return out


def _tools(tools, where: str) -> list | None:
    """A row's tools: a list of function definitions (or a JSON string of one), each with a
    name; None for none."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise DoelError(f"{where}: tools is a string but not JSON ({e.msg})") from None
    if not tools:
        return None
    if not isinstance(tools, list):
        raise DoelError(f"{where}: tools must be a list of function definitions")
    for j, t in enumerate(tools, 1):
        f = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise DoelError(
                f'{where}: tool {j} must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": {{...}}}}}}, got {str(t)[:80]}'
            )
    return tools


# ------------------------------------------------------------------ reading


def _messages_of(row, cfg: SFTConfig, where: str):
    if not isinstance(row, dict):
        raise DoelError(f"{where}: a conversation must be a JSON object, got {type(row).__name__}")
    if cfg.prompt_field:
        missing = [f for f in (cfg.prompt_field, cfg.response_field) if f not in row]
        if missing:
            raise DoelError(f"{where}: no {missing[0]!r} field (found {sorted(row)})")
        return [
            {"role": "user", "content": row[cfg.prompt_field]},
            {"role": "assistant", "content": row[cfg.response_field]},
        ]
    if cfg.messages_field not in row:
        raise DoelError(
            f"{where}: no {cfg.messages_field!r} field (found {sorted(row)}); a conversation "
            'is {"messages": [{"role": "user", "content": "..."}, ...]}, or set prompt_field '
            "and response_field for prompt-response rows"
        )
    return row[cfg.messages_field]


def _rows(path: str) -> Iterator[tuple[str, object]]:
    """(where, row) for each row of one file or hub dataset."""
    if path.startswith("hf:"):
        try:
            import datasets
        except ModuleNotFoundError:
            raise DoelError(
                "reading hf:NAME needs the datasets package: pip install datasets"
            ) from None
        name, _, config = path[3:].partition(":")
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
        for n, row in enumerate(ds, 1):
            yield f"{path} row {n}", row
    elif path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DoelError(f"{path}:{lineno}: invalid UTF-8") from None
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DoelError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield f"{path} row {n}", row
    else:
        raise DoelError(
            f"{path}: chat data must be .jsonl or .parquet (one conversation a row: "
            '{"messages": [...]}) or hf:NAME'
        )


def iter_conversations(
    sources: list[Source], cfg: SFTConfig, stats: dict
) -> Iterator[tuple[str, str, list[dict]]]:
    """(source name, where, checked messages) for every conversation kept. `stats` counts
    rows left out by keep_rows and, with skip_malformed, bad ones (the first named)."""
    key, _, value = cfg.keep_rows.partition("=")
    for src in sources:
        for path in src.paths:
            for where, row in _rows(path):
                if key and isinstance(row, dict) and key in row and str(row[key]) != value:
                    stats["filtered"] = stats.get("filtered", 0) + 1
                    continue
                try:
                    tools = (
                        None if cfg.prompt_field or not isinstance(row, dict) else row.get("tools")
                    )
                    messages = check_messages(_messages_of(row, cfg, where), where, tools)
                except DoelError as e:
                    if not cfg.skip_malformed:
                        raise
                    stats["malformed"] = stats.get("malformed", 0) + 1
                    stats.setdefault("first_malformed", str(e))
                    continue
                yield src.name, where, messages
