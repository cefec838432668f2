"""The source model's own chat format, as every exported format carries it: its Jinja chat template
and the special token that ends its turns.

The template is tokenizer_config.json's `chat_template` (a string, or transformers' named list
whose "default" is taken), else `chat_template.jinja` beside it: transformers 4.4x's
`save_pretrained` writes it there, not into tokenizer_config.json. The bundle carries it in its
tokenizer_config.json, where doel-serve, transformers and onnxruntime-genai's
`apply_chat_template` read it; the GGUF as `tokenizer.chat_template`; the Ollama Modelfile as a
Go TEMPLATE where one renders the same prompt (export/modelfile.py).

The end of a turn is what the template writes right after an assistant's reply: rendered (in
jinja2's sandbox, as transformers and doel-serve render it) on a user message and a reply, the
special token that follows the reply's text: `<|end|>` for doel's template, `<|im_end|>` for
ChatML, `<|eot_id|>` for Llama 3's. It is one of the model's stop tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from doel.contracts import read_json, untrusted

TEMPLATE_FILE = "chat_template.jinja"
_REPLY = "\x00reply\x00"  # the reply's text in the probe: no template writes it itself


def read_template(folder: Path) -> str | None:
    """The chat template of the tokenizer in `folder`, or None."""
    config = read_json(folder / "tokenizer_config.json") or {}
    template = config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    path = folder / TEMPLATE_FILE
    if path.is_file():
        untrusted.file_bytes(path, untrusted.MAX_RECORD_BYTES)
        return path.read_text(encoding="utf-8") or None
    return None


def _token(value) -> str:
    """A special token as tokenizer_config.json writes it: a string, or a dict with content."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else ""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter (Jinja's own escapes HTML characters and sorts keys)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def render(template: str, messages: list[dict], config: dict, **kw) -> str:
    """`messages` through `template` as transformers renders them (sandboxed, trim_blocks,
    lstrip_blocks, its tojson); jinja2's TemplateError where the template refuses."""

    def refuse(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = refuse
    env.filters["tojson"] = _tojson
    tokens = {k: _token(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
    return env.from_string(template).render(messages=messages, **tokens, **kw)


def end_of_turn(template: str | None, config: dict, specials: list[str]) -> str | None:
    """The special token (of `specials`) the template writes right after a reply; None when it
    writes none there, or cannot render a user message and a reply."""
    if template is None:
        return None
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _REPLY}]
    try:
        shown = render(template, chat, config, add_generation_prompt=False)
    except Exception:  # noqa: BLE001  (a template that cannot render this names no end)
        return None
    _, found, after = shown.partition(_REPLY)
    for token in sorted(specials, key=len, reverse=True):
        if found and token and after.startswith(token):
            return token
    return None
