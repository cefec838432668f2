"""The bundle's chat template: messages → the prompt's token ids, as transformers'
`apply_chat_template` renders them, without letting a message inject a control token.

The template is the one in the bundle's tokenizer_config.json (`chat_template`); a request never
brings its own. It is rendered as transformers renders it, in jinja2's immutable sandbox with
trim_blocks and lstrip_blocks, and the text is tokenized as a tokenizer.json tokenizes any text:
split at the added tokens, each piece between them encoded on its own. The difference is where a
message's content spells a special token ("<|end|>"): transformers would encode that as the
control token, so a user could close their turn and write the assistant's; here the content is
rendered as a placeholder, the template's own text is split at its special tokens, and the
content goes in as text (checked: the content in the placeholders' places is what the template
renders from it), which for content without such spellings gives transformers' ids
exactly
(tests/serve/endpoints/test_chat.py). A template that does not place content verbatim (it trims
or edits it) is rendered with the content itself, and content that spells a special token is
then refused.

Tools and tool calls (`tools=`, an assistant's `tool_calls`) are rendered as transformers
renders them, with its `tojson` filter (no HTML escaping, keys in their order); they are not
content, so a name, description, schema or argument that spells a special token is refused
(one pass over their JSON). `prefix` is text the reply is made to start with (a forced
`<tool_call>`), encoded with the text after the assistant's marker as a reply would be.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from doel.contracts import read_json

END = "<|end|>"  # the end of a turn: the model closes its reply with it


class ChatError(Exception):
    """A conversation the template cannot render; the message says why."""


def _raise(message: str):
    raise TemplateError(message)  # templates call raise_exception(...) to refuse a conversation


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter (Jinja's own escapes HTML characters and sorts keys)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or a dict with content."""
    return value.get("content") if isinstance(value, dict) else value


def read_template(folder: Path) -> str | None:
    """The bundle's chat template, or None: a missing file, key, or unreadable config alike."""
    config = read_json(folder / "tokenizer_config.json")
    template = config.get("chat_template") if config else None
    if isinstance(template, list):  # transformers' named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def generation_stops(folder: Path) -> tuple[int, ...]:
    """The stop ids generation_config.json lists (`eos_token_id`, an id or a list): a model
    someone else trained may end its turns on a token other than its EOS (Llama 3's
    <|eot_id|>), and keeps its own stop tokens (doel-train import writes them there)."""
    config = read_json(folder / "generation_config.json") or {}
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


class ChatTemplate:
    """Renders conversations for one bundle; `stop_ids` end a reply (<|end|>, EOS, and the
    stop ids of its generation_config.json that are special tokens)."""

    def __init__(self, source: str, tokenizer_file: Path, config: dict, stops: tuple = ()):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source)
        # Its own instance: encode_special_tokens is the tokenizer's state, and the service's
        # tokenizer encodes completions' prompts, where a spelled token is the token.
        self.text = Tokenizer.from_file(str(tokenizer_file))
        self.text.encode_special_tokens = True
        added = self.text.get_added_tokens_decoder()
        self.specials = {t.content: i for i, t in added.items()}
        # Longest first: where two added tokens start at one place the longer one is taken.
        alternatives = sorted(self.specials, key=len, reverse=True)
        self.split = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self.tokens = {
            k: _token_text(config.get(k)) or "" for k in ("bos_token", "eos_token", "pad_token")
        }
        eos = self.specials.get(self.tokens["eos_token"])
        listed = [i for i in stops if i in self.specials.values()]  # never an ordinary token
        found = (self.specials.get(END), eos, *listed)
        self.stop_ids = tuple(dict.fromkeys(i for i in found if i is not None))

    @classmethod
    def load(cls, folder: Path) -> ChatTemplate | None:
        source = read_template(folder)
        if source is None:
            return None
        config = read_json(folder / "tokenizer_config.json")
        return cls(source, folder / "tokenizer.json", config, generation_stops(folder))

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        try:
            shown = self.template.render(
                messages=messages, tools=tools, add_generation_prompt=True, **self.tokens
            )
        except TemplateError as e:
            raise ChatError(f"the model's chat template refused the conversation: {e}") from e
        return shown

    def ids(
        self, messages: list[dict], tools: list[dict] | None = None, prefix: str = ""
    ) -> list[int]:
        """The prompt's ids, ending with the assistant's turn marker (and `prefix`). Linear in
        the conversation: one pattern, whatever the number of messages, and one pass over the
        rendered text (a pattern with an alternative per message, and index/count calls per
        placeholder, were not)."""
        self._check_structured(messages, tools)
        nonce = secrets.token_hex(8)
        marks = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
        shown = self.render([m | {"content": k} for m, k in zip(messages, marks)], tools)
        cuts = re.split(f"\x00{nonce}:(\\d+)\x00", shown)
        # Text, then (message index, text) pairs. Verbatim: each placeholder once, in order,
        # and the content itself in their places gives what the template renders from it (a
        # template may trim or edit content).
        order = [int(i) for i in cuts[1::2]]
        if order != list(range(len(messages))):
            return self._ids_verbatim(messages, tools, prefix)
        contents = [m["content"] for m in messages]
        placed = "".join(c if j % 2 == 0 else contents[int(c)] for j, c in enumerate(cuts))
        if placed != self.render(messages, tools):
            return self._ids_verbatim(messages, tools, prefix)
        # The template's text between the placeholders, split at its special tokens; the
        # content joins the text around it (which a tokenizer would not split from it either).
        pieces = _Pieces()
        for j, part in enumerate(cuts):
            if j % 2:
                pieces.text(contents[int(part)])
            else:
                self._split(part, pieces)
        pieces.text(prefix)
        return self._encode(pieces.done())

    def _check_structured(self, messages: list[dict], tools: list[dict] | None) -> None:
        """Tools and tool calls are printed as the template likes (JSON, or raw): none of
        their strings may spell a special token."""
        calls = [m.get("tool_calls") for m in messages if m.get("tool_calls")]
        if not (tools or calls) or self.split is None:
            return
        found = self.split.search(_tojson([tools, calls]))
        if found:
            raise ChatError(
                f"a tool definition or tool call spells the special token {found.group()!r}, "
                "which this model's chat template cannot keep as text; remove it"
            )

    def _ids_verbatim(
        self, messages: list[dict], tools: list[dict] | None = None, prefix: str = ""
    ) -> list[int]:
        for i, m in enumerate(messages):
            found = self.split.search(m["content"]) if self.split else None
            if found:
                raise ChatError(
                    f"message {i} spells the special token {found.group()!r}, which this "
                    "model's chat template cannot keep as text; remove it"
                )
        pieces = _Pieces()
        self._split(self.render(messages, tools), pieces)
        pieces.text(prefix)
        return self._encode(pieces.done())

    def _split(self, text: str, pieces: _Pieces) -> None:
        """Add `text` to `pieces`: its special tokens as ids, the text between them joined to
        the text piece before."""
        pos = 0
        for m in self.split.finditer(text) if self.split else ():
            pieces.text(text[pos : m.start()])
            pieces.special(self.specials[m.group()])
            pos = m.end()
        pieces.text(text[pos:])

    def _encode(self, pieces: list[str | int]) -> list[int]:
        texts = [p for p in pieces if isinstance(p, str) and p]
        encoded = iter(self.text.encode_batch_fast(texts, add_special_tokens=False))
        ids: list[int] = []
        for p in pieces:
            if isinstance(p, int):
                ids.append(p)
            elif p:
                ids += next(encoded).ids
        return ids


class _Pieces:
    """Texts and special-token ids in order, the texts between two ids joined once at the end
    (joining as they come copies the text so far at each part: quadratic in a long turn)."""

    def __init__(self):
        self.out: list[str | int] = []
        self.parts: list[str] = []

    def text(self, part: str) -> None:
        self.parts.append(part)

    def special(self, token: int) -> None:
        self.out += ["".join(self.parts), token]
        self.parts = []

    def done(self) -> list[str | int]:
        return [*self.out, "".join(self.parts)]
