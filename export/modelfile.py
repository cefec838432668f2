"""The Ollama Modelfile beside a GGUF: its context, doel's sampling defaults, its stop strings and,
for doel's chat template, a TEMPLATE in Go's text/template that renders the same prompt.

Why a TEMPLATE: Ollama does not run a GGUF's Jinja template. `ollama create` compares it with the
templates it knows and, when none is close, uses `{{ .Prompt }}`, which drops every role
(ollama template/template.go, `Named` and `DefaultTemplate`). So the Modelfile carries doel's
CHAT_TEMPLATE (train/data/tokenizer.py) rewritten for the data Ollama gives a template: `.Messages`
(Role, Content, ToolCalls with .Function.Name and .Function.Arguments, a map) and `.Tools` (each
.Function with Name, Description, Parameters.Type/Properties/Required), after Ollama has merged
consecutive messages of one role with "\\n\\n" (`collate`). What it renders equals the Jinja
prompt byte for byte (tests/export/test_ollama_template.py runs Go's own text/template on it),
given what Ollama keeps of a conversation:
- no <|bos|> in front: Ollama's tokenizer adds it, as the GGUF's add_bos_token says
  (tokenizer/vocabulary.go `addSpecials`);
- tool-call arguments and tool properties come in Go's map order (keys sorted), as Ollama turns
  them into maps before the template sees them; tools keep the fields Ollama's api.Tool has;
- numbers as Go writes a float64 (integers and plain decimals as Python does).
JSON inside the prompt is written by the template itself, not by Ollama's `json` function: Go's
encoding/json escapes <, > and & and has no spaces, Jinja's `tojson` (transformers') does
neither. Strings are escaped a byte at a time (`"s"`/`"c"` below: \\", \\\\, control characters),
so a string of more than about 100,000 bytes in a tool definition or call's arguments exceeds
text/template's nesting limit. An assistant message last is not continued (every prompt ends
with <|assistant|>, as doel-serve's do).

A model of someone else's whose template renders ChatML (`<|im_start|>role\ncontent<|im_end|>\n`
a message, `<|im_start|>assistant\n` last, a default system message in front where the first is
not the system's, tools ignored: SmolLM2's) gets CHATML_GO, with that system text: the template
is recognised by what it renders (`chatml_system`, on PROBES), not by its spelling. Ollama merges
consecutive messages of one role before the template sees them, as for doel's.

Any other template (or none) gets `TEMPLATE {{ .Prompt }}`: the text is the prompt as it is,
which is what a base model completes. doel's base and chat models share the tokenizer and so the
template; the chat TEMPLATE is written for both (`ollama run --raw` gives a base model plain
text). The stops are the model's end of a turn (export/chat.py) where a TEMPLATE renders turns,
and its EOS.
"""

from __future__ import annotations

import hashlib
import json

from doel.contracts import read_json
from doel.export import chat
from doel.export.checkpoint import Checkpoint

# sha256 of the Jinja templates CHAT_TEMPLATE_GO renders the same prompt as (doel's CHAT_TEMPLATE;
# tests/export/test_ollama_template.py fails when the Jinja one changes and this does not).
DOEL_TEMPLATES = ("03d9f4f29b242a9f9642c6c5137ecb76c876c50c28eba6eb3c7f66c4a64088a2",)

_STRING = (
    # "s": a JSON string as Python's json.dumps(ensure_ascii=False) writes it; "c": its bytes.
    '{{- define "s" }}"{{ template "c" . }}"{{ end }}'
    '{{- define "c" }}{{ if . }}{{ $b := index . 0 }}'
    '{{ if eq $b 34 }}\\"{{ else if eq $b 92 }}\\\\{{ else if eq $b 10 }}\\n'
    "{{ else if eq $b 13 }}\\r{{ else if eq $b 9 }}\\t{{ else if eq $b 8 }}\\b"
    '{{ else if eq $b 12 }}\\f{{ else if lt $b 32 }}{{ printf "\\\\u%04x" $b }}'
    '{{ else }}{{ slice . 0 1 }}{{ end }}{{ template "c" (slice . 1) }}{{ end }}{{ end }}\n'
)
_VALUES = (
    # "v": any JSON value decoded by Go; "o": an object, keys in Go's (sorted) order.
    '{{- define "v" }}{{ $t := printf "%T" . }}{{ if eq $t "string" }}{{ template "s" . }}'
    '{{ else if eq $t "map[string]interface {}" }}{{ template "o" . }}'
    '{{ else if eq $t "[]interface {}" }}[{{ range $i, $x := . }}{{ if $i }}, {{ end }}'
    '{{ template "v" $x }}{{ end }}]{{ else if eq $t "<nil>" }}null'
    "{{ else }}{{ json . }}{{ end }}{{ end }}\n"
    '{{- define "o" }}{{ "{" }}{{ $sep := "" }}{{ range $k, $v := . }}{{ $sep }}'
    '{{ template "s" $k }}: {{ template "v" $v }}{{ $sep = ", " }}{{ end }}}{{ end }}\n'
)
_TOOLS = (
    # "f": a tool's function as the Jinja template writes it (name, description, parameters:
    # "" and {} where absent); "p": one parameter.
    '{{- define "f" }}{{ "{" }}"name": {{ template "s" .Name }}'
    ', "description": {{ template "s" .Description }}, "parameters": '
    '{{ if not .Parameters.Type }}{{ "{" }}}{{ else }}'
    '{{ "{" }}"type": {{ template "s" .Parameters.Type }}'
    ', "properties": {{ "{" }}{{ $sep := "" }}{{ range $k, $p := .Parameters.Properties }}'
    '{{ $sep }}{{ template "s" $k }}: {{ template "p" $p }}{{ $sep = ", " }}{{ end }}}'
    '{{ if .Parameters.Required }}, "required": [{{ range $i, $r := .Parameters.Required }}'
    '{{ if $i }}, {{ end }}{{ template "s" $r }}{{ end }}]{{ end }}}{{ end }}}{{ end }}\n'
    '{{- define "p" }}{{ "{" }}"type": {{ if eq (len .Type) 1 }}{{ template "s" (index .Type 0) }}'
    '{{ else }}[{{ range $i, $t := .Type }}{{ if $i }}, {{ end }}{{ template "s" $t }}{{ end }}]'
    '{{ end }}{{ if .Description }}, "description": {{ template "s" .Description }}{{ end }}'
    '{{ if .Enum }}, "enum": [{{ range $i, $e := .Enum }}{{ if $i }}, {{ end }}'
    '{{ template "v" $e }}{{ end }}]{{ end }}'
    '{{ if .Items }}, "items": {{ template "v" .Items }}{{ end }}}{{ end }}\n'
)
_PROMPT = (
    # The tools block (with the first message's text when it is the system's), then each
    # message, then the assistant's marker: doel's CHAT_TEMPLATE, branch for branch (an
    # assistant's two branches in one: the same bytes). The calls sit in `if .ToolCalls`, whose
    # first text is <tool_call>: the tag Ollama's tool parser takes from a template
    # (tools/template.go parseTag), so it reads the model's calls back as tool_calls.
    "{{- if .Tools }}<|system|>{{ if .Messages }}{{ with index .Messages 0 }}"
    '{{ if eq .Role "system" }}{{ .Content }}{{ "\\n\\n" }}{{ end }}{{ end }}{{ end }}'
    'Functions you may call, as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:'
    '{{ "\\n" }}{{ range .Tools }}{{ template "f" .Function }}{{ "\\n" }}{{ end }}'
    "<|end|>{{ end }}\n"
    "{{- range $i, $m := .Messages }}\n"
    '{{- if and $.Tools (eq $i 0) (eq .Role "system") }}\n'
    '{{- else if eq .Role "tool" }}<|user|><tool_response>{{ .Content }}</tool_response><|end|>\n'
    '{{- else if eq .Role "assistant" }}<|assistant|>{{ .Content }}{{ if .ToolCalls }}\n'
    '{{- range .ToolCalls }}<tool_call>{{ "{" }}"name": {{ template "s" .Function.Name }}, '
    '"arguments": {{ template "o" .Function.Arguments }}}</tool_call>{{ end }}{{ end }}<|end|>\n'
    "{{- else }}<|{{ .Role }}|>{{ .Content }}<|end|>\n"
    "{{- end }}\n"
    "{{- end }}<|assistant|>"
)
CHAT_TEMPLATE_GO = _STRING + _VALUES + _TOOLS + _PROMPT
RAW_TEMPLATE = "{{ .Prompt }}"


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


# ChatML in Go: `.Messages` each as <|im_start|>role, newline, content, <|im_end|>, newline; the
# default system message (%s, Go-quoted) before a first message that is not the system's.
CHATML_GO = (
    "{{- range $i, $m := .Messages }}"
    '{{- if and (eq $i 0) (ne .Role "system") (ne %s "") }}<|im_start|>system\n{{ %s }}'
    "<|im_end|>\n{{ end }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n"
)
# Conversations a template must render as ChatML does to be given CHATML_GO.
_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}
PROBES = [
    ([{"role": "user", "content": "Hi"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "আমি\nভাত খাই"}], None),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
      {"role": "user", "content": " b "}], None),
    ([{"role": "user", "content": "Hi"}], [_TOOL]),
]  # fmt: skip


def chat_template(ckpt: Checkpoint) -> str | None:
    """The checkpoint's Jinja chat template (export/chat.py), or None."""
    return ckpt.chat_template


def _chatml(messages: list[dict], system: str) -> str:
    out = ""
    for i, m in enumerate(messages):
        if i == 0 and m["role"] != "system" and system:
            out += f"<|im_start|>system\n{system}<|im_end|>\n"
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def chatml_system(jinja: str, config: dict) -> str | None:
    """The default system text ("" for none) of a template that renders PROBES as ChatML does;
    None for any other template."""
    try:
        shown = [chat.render(jinja, m, config, tools=t, add_generation_prompt=True)
                 for m, t in PROBES]  # fmt: skip
    except Exception:  # noqa: BLE001  (a template that cannot render them is not ChatML)
        return None
    head = "<|im_start|>system\n"
    system = ""
    if shown[0].startswith(head) and "<|im_end|>" in shown[0]:
        system = shown[0][len(head) : shown[0].index("<|im_end|>")]
    ok = all(s == _chatml(m, system) for s, (m, _) in zip(shown, PROBES))
    return system if ok else None


def ollama_template(ckpt: Checkpoint) -> str:
    """The Modelfile's TEMPLATE: doel's chat prompt or ChatML in Go, or the raw prompt (module
    docstring)."""
    jinja = chat_template(ckpt)
    if jinja is None:
        return RAW_TEMPLATE
    if template_sha256(jinja) in DOEL_TEMPLATES:
        return CHAT_TEMPLATE_GO
    config = read_json(ckpt.tokenizer.parent / "tokenizer_config.json") or {}
    system = chatml_system(jinja, config)
    if system is None:
        return RAW_TEMPLATE
    quoted = json.dumps(system, ensure_ascii=False)  # a Go string literal (JSON's escapes)
    return CHATML_GO.replace("%s", quoted)


def stop_strings(ckpt: Checkpoint, chat: bool) -> list[str]:
    """Where Ollama ends a reply: the end of a turn (a chat TEMPLATE) and the EOS token."""
    roles = ("end_of_turn", "eos") if chat else ("eos",)
    stops = [ckpt.special_tokens[r]["token"] for r in roles if r in ckpt.special_tokens]
    return list(dict.fromkeys(stops))


def modelfile(gguf_name: str, ckpt: Checkpoint) -> str:
    """An Ollama Modelfile: the GGUF, its context, doel's sampling defaults, the TEMPLATE and
    the stop strings."""
    lines = [f"FROM ./{gguf_name}", f"PARAMETER num_ctx {ckpt.context_length}"]
    g = read_json(ckpt.folder / "generation_config.json") or {}
    for key in ("temperature", "top_k", "top_p"):
        if g.get(key) is not None:
            lines.append(f"PARAMETER {key} {g[key]}")
    template = ollama_template(ckpt)
    lines += [f'PARAMETER stop "{s}"' for s in stop_strings(ckpt, template != RAW_TEMPLATE)]
    lines.append(f'TEMPLATE """{template}"""')
    return "\n".join(lines) + "\n"
