"""llama-server's own Jinja engine (`--jinja`, llama.cpp's common/jinja, not Python's jinja2) on
a doel chat GGUF: `POST /apply-template` of each conversation (OpenAI messages and tools, as a
client sends them) against doel-serve's prompt text for the same request (its ChatCompletion
request's turns and tools through serve/core/template.py), and a streamed /v1/chat/completions reply
that ends at the end-of-turn marker <|end|>.

llama.cpp leaves the template's leading <|bos|> out of the text when the model adds BOS itself
(common/chat.cpp, `add_bos` and `bos_token`), so the server's text is compared with doel-serve's
after its <|bos|>. The model is random (benchmarks/runtimes/ollama.py `chat_checkpoint`), and
a copy fine-tuned on the sample's conversations (`trained_chat_gguf`) ends its replies itself.
On the random one the stop is also shown with `logit_bias`: +100 on <|end|> makes the model
write it (the reply must end there: "stop", the marker not in the text), -100 keeps it out
(the reply then runs to max_tokens: "length"), so the stop is the marker's, not an accident.

One difference is llama-server's, before its template engine: it rebuilds each OpenAI function
as name, description and parameters, "" and {} where absent, other fields dropped
(common/chat.cpp, parsing the request's tools), where doel-serve passes a definition's fields as
sent; so a function without `parameters` reaches the template as `"parameters": {}`. Such
conversations are counted apart, with that difference checked exactly (`as_llama_server_reads`).
Rows from `rows(work)`; `python -m benchmarks.runtimes.llama_server` prints them as JSON.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.load.load_servers import BINARY, LLAMA_VERSION, free_port
from benchmarks.runtimes.ollama import chat_checkpoint, conversations

RUNTIME = "llama-server --jinja (llama.cpp)"
ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "train" / "sample" / "chat.jsonl"


def openai_request(case: dict) -> dict:
    """The case as an OpenAI chat request: calls get ids and JSON-text arguments, each tool
    message the id of the call it answers."""
    messages, ids = [], []
    for m in case["messages"]:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                ids.append(f"call_{len(ids)}")
                f = c["function"]
                args = json.dumps(f["arguments"], ensure_ascii=False)
                calls.append({"id": ids[-1], "type": "function",
                              "function": {"name": f["name"], "arguments": args}})  # fmt: skip
            m["tool_calls"] = calls
        elif m["role"] == "tool":
            m["tool_call_id"] = ids.pop(0)
        messages.append(m)
    return {"messages": messages} | ({"tools": case["tools"]} if case["tools"] else {})


def doel_serve_prompt(ckpt: Path, request: dict) -> str:
    """The prompt text doel-serve renders for this chat request."""
    from doel.serve.core.template import ChatTemplate
    from doel.serve.endpoints.chat.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(request)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return ChatTemplate.load(ckpt).render(req.turns(), tools)


def post(port: int, path: str, body: dict, timeout: float = 60) -> bytes:
    url, head = f"http://127.0.0.1:{port}{path}", {"Content-Type": "application/json"}
    req = urllib.request.Request(url, json.dumps(body).encode(), head)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def llama_version(binary: Path = BINARY) -> str:
    """The build `llama-server --version` names, and the source package it came from."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    line = next((x for x in (out.stdout + out.stderr).splitlines() if "version" in x), "?")
    return f"{line.split(':', 1)[-1].strip()}, llama-cpp-python {LLAMA_VERSION}'s llama.cpp"


class LlamaServer:
    """llama-server --jinja on one GGUF, on a free port; `with` stops it."""

    def __init__(self, gguf: Path, log: Path, binary: Path = BINARY):
        self.port, self.log = free_port(), open(log, "ab")
        cmd = [str(binary), "-m", str(gguf), "--jinja", "--host", "127.0.0.1",
               "--port", str(self.port), "-t", "1", "-c", "1024", "--no-webui"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.3)
        raise RuntimeError("llama-server was not ready after 120 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def json(self, path: str, body: dict, timeout: float = 60) -> dict:
        """POST `body` to `path`; the answer's JSON."""
        return json.loads(post(self.port, path, body, timeout))

    def applied(self, request: dict) -> str:
        return self.json("/apply-template", request)["prompt"]

    def stream(self, request: dict, bias: dict[int, float], max_tokens: int = 8):
        """(the streamed reply's text, its finish_reason), greedy."""
        body = request | {"stream": True, "max_tokens": max_tokens, "temperature": 0,
                          "logit_bias": [[int(i), b] for i, b in bias.items()]}  # fmt: skip
        text, finish = "", None
        for line in post(self.port, "/v1/chat/completions", body).decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
        return text, finish


def trained_chat_gguf(work: Path) -> Path:
    """`chat_checkpoint`'s model fine-tuned (doel-train sft, 400 steps of the tiny config) on
    the sample's conversations until it answers them and ends its turn; its f32 GGUF."""
    from doel.export.gguf import export_gguf
    from doel.train.config import load_config
    from doel.train.data.chat import SFTConfig
    from doel.train.sft import sft

    out = work / "sft-gguf"
    if not (out / "manifest.json").is_file():
        sets = ["seq_len=128", "batch_size=8", "steps=400", "lr=3e-3", "log_every=400",
                "eval_every=0", "checkpoint_every=0"]  # fmt: skip
        cfg = load_config(SFTConfig, ROOT / "configs" / "tiny.toml", sets)
        base = chat_checkpoint(work)
        final = sft(cfg, [str(CHAT)], base, work / "sft", log=lambda _m: None, skip_verify=True)
        export_gguf(final, out, quant="f32", force=True, log=lambda _m: None)
    return out / "model-f32.gguf"


def questions(n: int = 3) -> list[list[dict]]:
    """The first `n` sample conversations up to their first user message."""
    rows = [json.loads(line) for line in CHAT.read_text(encoding="utf-8").splitlines()[:n]]
    return [r["messages"][: 1 + [m["role"] for m in r["messages"]].index("user")] for r in rows]


def trained_replies(work: Path) -> list[tuple[str, str]]:
    """(text, finish_reason) of the trained chat model's streamed greedy reply to each
    question, from llama-server."""
    with LlamaServer(trained_chat_gguf(work), work / "llama-server-sft.log") as s:
        return [s.stream({"messages": q}, {}, max_tokens=64) for q in questions()]


def end_id(ckpt: Path) -> int:
    tok = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    return next(a["id"] for a in tok["added_tokens"] if a["content"] == "<|end|>")


def declares_parameters(request: dict) -> bool:
    return all("parameters" in t["function"] for t in request.get("tools", []))


def as_llama_server_reads(request: dict) -> dict:
    """The request's tools as llama-server passes them to a template (common/chat.cpp): each
    function rebuilt as name, description ("" when absent) and parameters ({} when absent),
    any other field (`strict`) dropped."""
    tools = [
        {"type": "function", "function": {"name": f["name"],
         "description": f.get("description", ""), "parameters": f.get("parameters", {})}}
        for f in (t["function"] for t in request.get("tools", []))
    ]  # fmt: skip
    return request | ({"tools": tools} if tools else {})


def compare(server: LlamaServer, ckpt: Path) -> dict[str, tuple[int, int, int]]:
    """For the conversations whose every function declares parameters ("declared") and the
    others ("undeclared"): (how many /apply-template texts differ from doel-serve's prompt,
    how many from doel-serve's prompt of the request as llama-server reads it, how many
    conversations)."""
    out = {"declared": [0, 0, 0], "undeclared": [0, 0, 0]}
    for case in conversations():
        request = openai_request(case)
        got = server.applied(request)
        row = out["declared" if declares_parameters(request) else "undeclared"]
        row[0] += got != doel_serve_prompt(ckpt, request).removeprefix("<|bos|>")
        filled = doel_serve_prompt(ckpt, as_llama_server_reads(request))
        row[1] += got != filled.removeprefix("<|bos|>")
        row[2] += 1
    return {k: tuple(v) for k, v in out.items()}


def rows(work: Path) -> list[dict]:
    if not BINARY.is_file():
        return [{"runtime": RUNTIME, "version": "not built", "check": "/apply-template",
                 "result": "skipped: `python -m benchmarks.load.bench_load --install-llama-server`",
                 "ok": False}]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    ckpt = chat_checkpoint(work)
    request = {"messages": [{"role": "user", "content": "আজ ঢাকার আবহাওয়া কেমন?"}]}
    with LlamaServer(work / "gguf" / "model-f32.gguf", work / "llama-server.log") as s:
        counts = compare(s, ckpt)
        end = end_id(ckpt)
        stopped = s.stream(request, {end: 100.0})
        ran_on = s.stream(request, {end: -100.0})
    version = llama_version()
    stops = stopped[1] == "stop" and "<|end|>" not in stopped[0] and ran_on[1] == "length"
    replies = trained_replies(work)
    ended = sum(f == "stop" and t.strip() and "<|end|>" not in t for t, f in replies)
    (d, _, n), (ud, uf, un) = counts["declared"], counts["undeclared"]
    return [
        {"runtime": RUNTIME, "version": version,
         "check": "/apply-template = doel-serve's prompt (every function with parameters)",
         "result": f"{d} of {n} differ", "ok": d == 0 and n > 0},
        {"runtime": RUNTIME, "version": version,
         "check": "/apply-template, a function without parameters",
         "result": f"{ud} of {un} differ from doel-serve's prompt, llama-server passing "
                   f'"parameters": {{}}; of the request as it reads it, {uf} of {un}',
         "ok": ud == 0 and un > 0},
        {"runtime": RUNTIME, "version": version,
         "check": "streamed reply stops at <|end|>",
         "result": f"<|end|> forced: finish_reason {stopped[1]!r}, text {stopped[0]!r}; "
                   f"<|end|> barred: {ran_on[1]!r}", "ok": stops},
        {"runtime": RUNTIME, "version": version,
         "check": "a chat model trained to end its turn: streamed greedy replies",
         "result": f"{ended} of {len(replies)} end at <|end|> (finish_reason 'stop'), "
                   f"e.g. {replies[0][0]!r}", "ok": ended == len(replies)},
    ]  # fmt: skip


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
