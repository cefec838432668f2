"""The Ollama Modelfile of a doel chat GGUF: its TEMPLATE, run by Go's own text/template on the
data Ollama gives a template (tests/export/ollama_render), renders doel's Jinja prompt byte for
byte; it stops at every end-of-turn marker and keeps the model's context. The conversations are
benchmarks/runtimes/ollama.py's (Bangla, tools, tool calls, tool results, empty contents)."""

from __future__ import annotations

import hashlib
import json

import pytest

from benchmarks.runtimes import ollama
from doel.export.checkpoint import inspect_checkpoint
from doel.export.modelfile import DOEL_TEMPLATES, RAW_TEMPLATE, modelfile
from doel.train.data.tokenizer import CHAT_TEMPLATE, END, EOS, TOOL_CALL

NEEDS_GO = "Go is missing: apt-get install golang-go (Ollama's templates are Go text/template)"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(checkpoint, GGUF folder) of a random tiny chat-template model, built once a session."""
    work = tmp_path_factory.getbasetemp() / "runtimes-chat"
    work.mkdir(exist_ok=True)
    return ollama.chat_checkpoint(work), work / "gguf"


def test_the_go_template_is_written_for_the_chat_template_doel_trains_with():
    """A change of CHAT_TEMPLATE must come with its Go translation (export/modelfile.py)."""
    assert hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest() in DOEL_TEMPLATES


@pytest.mark.slow
def test_the_modelfile_stops_at_each_turn_end_and_keeps_the_context(chat):
    ckpt, gguf = chat
    lines = (gguf / "Modelfile").read_text(encoding="utf-8").splitlines()
    config = json.loads((ckpt / "config.json").read_text())
    assert f"PARAMETER num_ctx {config['max_position_embeddings']}" in lines
    assert [x for x in lines if x.startswith("PARAMETER stop")] == [
        f'PARAMETER stop "{END}"',
        f'PARAMETER stop "{EOS}"',
    ]
    assert lines[0] == "FROM ./model-f32.gguf"
    assert sum(x.startswith('TEMPLATE """') for x in lines) == 1


@pytest.mark.slow
def test_a_model_without_doels_chat_template_gets_the_raw_prompt(chat, tmp_path):
    """No chat template (or another one): TEMPLATE {{ .Prompt }}, the text as it is, and only
    the EOS stop."""
    ckpt, _ = chat
    side = json.loads((ckpt / "tokenizer_config.json").read_text())
    for template in (None, "{{ messages[0]['content'] }}"):
        folder = tmp_path / f"base-{template is None}"
        folder.mkdir()
        for f in ckpt.iterdir():
            if f.is_file():
                (folder / f.name).write_bytes(f.read_bytes())
        changed = {k: v for k, v in side.items() if k != "chat_template"}
        if template:
            changed["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(changed))
        text = modelfile("m.gguf", inspect_checkpoint(folder, None, verify=False))
        assert f'TEMPLATE """{RAW_TEMPLATE}"""' in text.splitlines()
        assert f'PARAMETER stop "{END}"' not in text
        assert f'PARAMETER stop "{EOS}"' in text


def _cases_have_the_tricky_shapes(cases):
    msgs = [c["messages"] for c in cases]
    shapes = {
        "system only": any(len(m) == 1 and m[0]["role"] == "system" for m in msgs),
        "tools, no system": any(c["tools"] and c["messages"][0]["role"] != "system" for c in cases),
        "text and a call": any(x.get("tool_calls") and x["content"] for m in msgs for x in m),
        "empty content": any(x["content"] == "" for m in msgs for x in m),
        "several calls": any(len(x.get("tool_calls", [])) > 1 for m in msgs for x in m),
        "tool result": any(x["role"] == "tool" for m in msgs for x in m),
        "multi-turn": any(sum(x["role"] == "assistant" for x in m) > 1 for m in msgs),
        "Bangla": sum(any("\u0980" <= ch <= "\u09ff" for ch in json.dumps(c, ensure_ascii=False))
                      for c in cases) >= 20,
    }  # fmt: skip
    return [k for k, ok in shapes.items() if not ok]


@pytest.mark.slow
def test_go_text_template_renders_doels_jinja_prompt_byte_for_byte(chat, tmp_path):
    if ollama.go() is None:
        pytest.skip(NEEDS_GO)
    ckpt, gguf = chat
    cases = [ollama.ollama_view(c) for c in ollama.conversations()]
    assert len(cases) >= 20 and _cases_have_the_tricky_shapes(cases) == []
    got = ollama.go_render(gguf / "Modelfile", cases, tmp_path)
    want = [t.removeprefix("<|bos|>") for t in ollama.jinja_renders(ckpt, cases)]
    assert [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w] == []
    assert all(g.endswith("<|assistant|>") and not g.startswith("<|bos|>") for g in got)


@pytest.mark.slow
def test_ollamas_tool_parser_finds_the_tool_call_tag_in_the_template(chat, tmp_path):
    """Ollama reads a model's calls back by the tag it finds in the TEMPLATE (tools/template.go
    parseTag, as ollama_render walks Go's parse tree): <tool_call>, what the model writes."""
    if ollama.go() is None:
        pytest.skip(NEEDS_GO)
    _, gguf = chat
    assert ollama.go_run(gguf / "Modelfile", [], tmp_path)["tool_call_tag"] == TOOL_CALL


@pytest.mark.slow
def test_the_go_render_can_differ_and_ollama_sorts_argument_keys(chat, tmp_path):
    """The comparison is not vacuous: a TEMPLATE missing one <|end|> differs, and a call whose
    argument keys are out of order comes out as Go orders a map (sorted), as Ollama passes it."""
    if ollama.go() is None:
        pytest.skip(NEEDS_GO)
    ckpt, gguf = chat
    text = (gguf / "Modelfile").read_text(encoding="utf-8")
    broken = tmp_path / "Modelfile"
    broken.write_text(text.replace("</tool_response><|end|>", "</tool_response>"), "utf-8")
    cases = ollama.conversations()
    with_tool = [c for c in cases if any(m["role"] == "tool" for m in c["messages"])]
    want = [t.removeprefix("<|bos|>") for t in ollama.jinja_renders(ckpt, with_tool)]
    got = ollama.go_render(broken, with_tool, tmp_path)
    assert all(g != w for g, w in zip(got, want, strict=True))
    unsorted = [c for c in with_tool if json.dumps(c) != json.dumps(ollama.ollama_view(c))]
    assert unsorted, "a conversation with argument keys out of Go's order"
    got = ollama.go_render(gguf / "Modelfile", unsorted, tmp_path)
    raw = [t.removeprefix("<|bos|>") for t in ollama.jinja_renders(ckpt, unsorted)]
    view = [ollama.ollama_view(c) for c in unsorted]
    held = [t.removeprefix("<|bos|>") for t in ollama.jinja_renders(ckpt, view)]
    assert got == held and all(g != r for g, r in zip(got, raw, strict=True))


@pytest.mark.slow
def test_transformers_renders_the_conversations_as_doel_serve_does(chat):
    """The Jinja side of the comparison is transformers' too (apply_chat_template)."""
    transformers = pytest.importorskip("transformers")
    ckpt, _ = chat
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    cases = [ollama.ollama_view(c) for c in ollama.conversations()]
    hf = [
        tok.apply_chat_template(
            c["messages"], tools=c["tools"], tokenize=False, add_generation_prompt=True
        )
        for c in cases
    ]
    assert hf == ollama.jinja_renders(ckpt, cases)
