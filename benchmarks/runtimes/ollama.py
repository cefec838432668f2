"""Ollama's chat prompt for a doel model, rendered by Go's own text/template: the Modelfile's
TEMPLATE (export/modelfile.py) on Ollama's data shape, against doel-serve's Jinja render of the
same conversations (serve/core/template.py, which transformers' apply_chat_template agrees with).

The Go side is tests/export/ollama_render (standard library only; Ollama's collate and
conversion rewritten there, citing Ollama's template/template.go), built with the `go` on PATH.
The conversations are Bangla and English, with the shapes that break templates: a system
message only, tools without a system message, an assistant message with text and a tool call,
an empty content, several tool calls, tool results, several turns. Jinja renders each as Ollama
holds it (`ollama_view`: argument keys and tool properties in Go's sorted order, as Ollama
turns them into maps), and Ollama adds <|bos|> itself (its tokenizer, from the GGUF's
add_bos_token), so Go's text is compared with Jinja's after its <|bos|>. Rows come from
`rows(work)`; `python -m benchmarks.runtimes.ollama` prints them as JSON (benchmarks/runtimes/
bench_runtimes.py writes the results file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RENDERER = ROOT / "tests" / "export" / "ollama_render"
SAMPLE = ROOT / "train" / "sample"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "একটি শহরের আজকের আবহাওয়া (weather & rain, <today>)",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "শহরের নাম"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": 'খোঁজ "উদ্ধৃতি" সহ\tএবং \\ চিহ্ন',
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": ["integer", "null"], "description": "কতগুলো"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now", "description": "এখন কটা বাজে"}}


def _call(name: str, args: dict) -> dict:
    return {"function": {"name": name, "arguments": args}}


def _m(role: str, content: str, *calls: dict) -> dict:
    return {"role": role, "content": content} | ({"tool_calls": list(calls)} if calls else {})


def conversations() -> list[dict]:
    """{"messages", "tools"} cases, each a conversation as a client sends it to Ollama."""
    sys_bn = _m("system", "তুমি একজন সহায়ক। বাংলায় উত্তর দাও।")
    user = _m("user", "আজ ঢাকার আবহাওয়া কেমন?")
    call = _call("get_weather", {"unit": "celsius", "city": "ঢাকা"})
    result = _m("tool", '{"temp": 31, "sky": "মেঘলা"}')
    nested = {"query": 'ঢাকা "বৃষ্টি"\n', "limit": 3}
    nested["tags"] = ["আবহাওয়া", None, True, 2.5, {"b": 1, "a": [1, 2]}]
    many = [call, _call("search", nested), _call("now", {})]
    odd = _call("search", {"query": "x & y < z\x01\b\f\u2028\x7f"})  # escapes JSON differs on
    turns = [_m(r, f"{r} বার্তা {i}") for i in range(3) for r in ("user", "assistant")]
    plain = [
        [_m("system", "শুধু সিস্টেম বার্তা।")],
        [user],
        [sys_bn, user],
        [sys_bn, user, _m("assistant", "গরম, ৩১°।"), _m("user", "আর কাল?")],
        [_m("user", "")],
        [user, _m("assistant", ""), _m("user", "আবার বলো")],
        [_m("user", 'Hello,\n  world\t<b>&amp;</b> "quoted" \\ back')],
        [_m("user", "ক্\u200dষ ক্\u200cষ য়া ড় ১২৩৪।। 😀 漢字")],
        [sys_bn, *turns, _m("user", "শেষ")],
        [user, _m("assistant", "দেখছি"), _m("system", "নতুন নির্দেশ"), _m("user", "বলো")],
    ]
    tools = [
        ([sys_bn, user], [WEATHER]),
        ([user], [WEATHER]),
        ([user], [WEATHER, SEARCH, NO_ARGS]),
        ([_m("system", "শুধু সিস্টেম, সাথে টুল।")], [SEARCH]),
        ([sys_bn, user, _m("assistant", "", call), result], [WEATHER]),
        ([user, _m("assistant", "দেখে নিচ্ছি।", call), result], [WEATHER]),
        ([user, _m("assistant", "", *many), result, _m("tool", "নেই"), _m("tool", "১০:৩০")],
         [WEATHER, SEARCH, NO_ARGS]),
        ([sys_bn, user, _m("assistant", "", call), result, _m("assistant", "৩১°, মেঘলা।"),
          _m("user", "ধন্যবাদ")], [WEATHER]),
        ([user, _m("assistant", "", call), _m("tool", "")], [WEATHER]),
        ([_m("user", "<tool_call> লেখা থাকলেও শুধু লেখা")], [NO_ARGS]),
        ([sys_bn, _m("user", "hi"), _m("assistant", "ok", odd), result], [SEARCH]),
        ([_m("user", "দুটো টুল")], [NO_ARGS, WEATHER]),
    ]  # fmt: skip
    return [{"messages": m, "tools": None} for m in plain] + [
        {"messages": m, "tools": t} for m, t in tools
    ]


def _sorted(value):
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def ollama_view(case: dict) -> dict:
    """The conversation as Ollama holds it: arguments and properties as Go maps (keys sorted)."""
    case = json.loads(json.dumps(case))
    for m in case["messages"]:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = _sorted(c["function"]["arguments"])
    for t in case["tools"] or []:
        props = t["function"].get("parameters", {}).get("properties")
        if props is not None:
            t["function"]["parameters"]["properties"] = {k: props[k] for k in sorted(props)}
    return case


def go() -> str | None:
    return shutil.which("go")


def go_env(scratch: Path) -> dict:
    """An environment where `go` builds offline: its caches under `scratch`, no proxy."""
    return os.environ | {
        "GOCACHE": str(scratch / "gocache"),
        "GOPATH": str(scratch / "gopath"),
        "GOFLAGS": "-mod=mod",
        "GOPROXY": "off",
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }


def go_version(scratch: Path) -> str:
    out = subprocess.run([go(), "version"], env=go_env(scratch), capture_output=True, text=True)
    return out.stdout.split()[2] if out.returncode == 0 else "unknown"


def go_render(modelfile: Path, cases: list[dict], scratch: Path) -> list[str]:
    """Each case rendered by the Modelfile's TEMPLATE in Go's text/template (ollama_render)."""
    return go_run(modelfile, cases, scratch)["prompts"]


def go_run(modelfile: Path, cases: list[dict], scratch: Path) -> dict:
    """ollama_render's answer: {"prompts": [...], "tool_call_tag": "..."}."""
    run = subprocess.run(
        [go(), "run", ".", str(modelfile.resolve())],
        cwd=RENDERER,
        input=json.dumps(cases, ensure_ascii=False),
        env=go_env(scratch),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        raise RuntimeError(f"ollama_render failed: {run.stderr.strip()}")
    return json.loads(run.stdout)


def chat_checkpoint(work: Path, quiet=lambda _m: None) -> Path:
    """A random tiny Llama on a fresh spm tokenizer (doel's chat template) and its GGUF beside
    it in work/gguf; returns the checkpoint folder."""
    import torch

    from doel.export.gguf import export_gguf
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    ckpt = work / "chat-ckpt"
    if not (work / "gguf" / "manifest.json").is_file():
        paths = resolve_sources([str(SAMPLE / "bn.txt"), str(SAMPLE / "en.txt")])
        cfg = TokenizerConfig(vocab_size=2048, style="spm")
        tok = train_tokenizer(paths, cfg, work / "tok", progress=False)
        torch.manual_seed(0)
        model = ModelConfig(
            vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True,
        )  # fmt: skip
        save_model(Llama(model), ckpt, tokenizer=tok)
        export_gguf(ckpt, work / "gguf", quant="f32", force=True, log=quiet)
    return ckpt


def jinja_renders(ckpt: Path, cases: list[dict]) -> list[str]:
    """doel-serve's prompt text for each case (serve/core/template.py's renderer)."""
    from doel.serve.core.template import ChatTemplate

    chat = ChatTemplate.load(ckpt)
    return [chat.render(c["messages"], c["tools"]) for c in cases]


def rows(work: Path) -> list[dict]:
    if go() is None:
        return [{"runtime": "Ollama TEMPLATE (Go text/template)", "version": "go missing",
                 "check": "renders doel's prompt", "result": "skipped: no `go` on PATH",
                 "ok": False}]  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    ckpt = chat_checkpoint(work)
    cases = [ollama_view(c) for c in conversations()]
    got = go_render(work / "gguf" / "Modelfile", cases, work)
    want = [t.removeprefix("<|bos|>") for t in jinja_renders(ckpt, cases)]
    differ = sum(g != w for g, w in zip(got, want, strict=True))
    return [
        {
            "runtime": "Ollama TEMPLATE (Go text/template)",
            "version": go_version(work),
            "check": "Modelfile TEMPLATE on Ollama's data = doel-serve's Jinja prompt",
            "result": f"{differ} of {len(cases)} conversations differ",
            "ok": differ == 0,
        }
    ]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
