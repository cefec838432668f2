"""llama-server's own template engine (`--jinja`) on a doel chat GGUF: `POST /apply-template`
gives doel-serve's prompt text for the conversations of benchmarks/runtimes/ollama.py (OpenAI
messages and tools), and a streamed /v1/chat/completions reply ends at <|end|>: forced on a
random model (and barred, for the contrast), and by itself on one fine-tuned to end its turns."""

from __future__ import annotations

import pytest

from benchmarks.runtimes import llama_server, ollama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not llama_server.BINARY.is_file():
        pytest.skip(
            "llama-server is not built: python -m benchmarks.load.bench_load --install-llama-server"
        )
    work = tmp_path_factory.getbasetemp() / "runtimes-chat"
    work.mkdir(exist_ok=True)
    ckpt = ollama.chat_checkpoint(work)
    with llama_server.LlamaServer(work / "gguf" / "model-f32.gguf", work / "ls.log") as s:
        yield s, ckpt


def test_apply_template_gives_doel_serves_prompt(server):
    """Every conversation's text equals doel-serve's (after <|bos|>, which llama.cpp leaves to
    its tokenizer); where a function has no parameters llama-server passes "parameters": {},
    and the text then equals doel-serve's for the request as llama-server reads it."""
    s, ckpt = server
    counts = llama_server.compare(s, ckpt)
    assert counts["declared"][0] == 0 and counts["declared"][2] >= 18
    assert counts["undeclared"][1] == 0 and counts["undeclared"][2] >= 1


def test_apply_template_renders_the_tools_block_and_calls(server):
    s, ckpt = server
    case = next(c for c in ollama.conversations() if c["tools"] and len(c["messages"]) > 3)
    text = s.applied(llama_server.openai_request(case))
    assert text.startswith("<|system|>") and "<tool_call>{" in text
    assert text.count("<tool_response>") == sum(m["role"] == "tool" for m in case["messages"])


def test_a_streamed_reply_stops_at_the_end_of_turn_marker(server):
    """With <|end|> forced the reply stops there ("stop", the marker not in the text); with it
    barred the same request runs to max_tokens ("length")."""
    s, ckpt = server
    end = llama_server.end_id(ckpt)
    request = {"messages": [{"role": "user", "content": "আজ ঢাকার আবহাওয়া কেমন?"}]}
    text, finish = s.stream(request, {end: 100.0})
    assert finish == "stop" and "<|end|>" not in text
    assert s.stream(request, {end: -100.0}, max_tokens=4)[1] == "length"


def test_a_chat_model_trained_to_end_its_turn_stops_there_in_llama_server(server):
    """A fine-tuned copy answers the sample's questions and its streamed replies end at <|end|>
    by themselves: finish_reason "stop", text without the marker."""
    s, ckpt = server
    replies = llama_server.trained_replies(ckpt.parent)
    assert [f for _, f in replies] == ["stop"] * len(replies)
    assert all(t.strip() and "<|end|>" not in t for t, _ in replies)


def test_the_gguf_names_the_end_of_turn_token(server):
    gguf = pytest.importorskip("gguf")
    s, ckpt = server
    reader = gguf.GGUFReader(str(next((ckpt.parent / "gguf").glob("*.gguf"))))
    field = reader.fields["tokenizer.ggml.eot_token_id"]
    assert int(field.parts[field.data[0]][0]) == llama_server.end_id(ckpt)
