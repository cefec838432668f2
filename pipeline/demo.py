"""`make demo`: the whole path on the built-in sample, in about a minute on 2 CPU cores (the
measured time, the machine it was measured on and what the chat part adds to it: README.md,
"Set-up: two commands"), so that a new reader sees every stage run before renting a GPU.

tokenizer → fertility → held-out split → shards → gradient-flow gate → training → evaluation
against the random twin and xz/bzip2 → samples → chat fine-tuning on the sample's conversations
(`doel-train sft`) → an int4 export bundle of each model → each served on loopback: one Bangla
completion from the base model and one chat exchange with the chat model fetched over HTTP and
printed, and with --serve the playground's URL (only then: the server stops with the demo). The
sample is only ~50 KB, so the model is tiny and the numbers show the path working, not a useful
model (`configs/small.toml` on real text is that).
"""

from __future__ import annotations

import json
import shlex
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from doel.train.common import SAMPLE_DIR, DoelError
from doel.train.config import load_config, resolve_config
from doel.train.data.conversations import SFTConfig
from doel.train.data.fertility import fertility, format_report, load_any
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.textio import iter_documents, iter_source, resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
from doel.train.evals.heldout import evaluate_checkpoint, format_eval
from doel.train.fit import fit
from doel.train.plot import plot_run
from doel.train.settings import TrainConfig
from doel.train.sft import sft

# The sample's ~25,000 training characters run out of merges a little past 2,600 tokens; at
# 2,048 every token is a learned one, and the smaller embedding trains faster.
DEMO_VOCAB = 2048
HOLDOUT_EVERY = 8  # every 8th paragraph of each sample file is held out for evaluation
# The completion the demo asks its server for; seeded, so the same bundle gives the same text.
# The prompt opens a paragraph of the sample: a model this small, trained on ~25,000
# characters, continues what it has read in readable Bangla, and a prompt it has never seen in
# a mix of half-remembered words (the evaluation's samples show both).
DEMO_REQUEST = {
    "prompt": "আমাদের গ্রামের নাম",
    "max_tokens": 32,
    "temperature": 0.8,
    "top_p": 0.95,
    "seed": 1,
}
# Chat fine-tuning of the pre-trained model on the sample's 44 conversations (train/sample/
# chat.jsonl): 100 steps of 8 are about 20 passes over them, so the model learns their answers
# by heart, and answers a question of the sample in its words (not a useful assistant).
CHAT_SETS = (
    "steps=100",
    "lr=1e-3",
    "warmup_steps=5",
    "seq_len=128",
    "log_every=25",
    "eval_every=50",
    "checkpoint_every=50",
)
DEMO_CHAT = {
    "messages": [{"role": "user", "content": "বাংলাদেশের রাজধানীর নাম কী?"}],
    "max_tokens": 24,
    "temperature": 0,
}
READY_SECONDS = 60  # loading an int4 bundle of the demo's size takes well under a second
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def split_sample(out: Path) -> tuple[list[str], list[str]]:
    """Write train/ and heldout/ copies of the sample files, split by paragraph."""

    train, held = [], []
    for name in ("bn.txt", "en.txt"):
        docs = list(iter_documents(str(SAMPLE_DIR / name)))
        parts = {"train": [], "heldout": []}
        for i, doc in enumerate(docs):
            parts["heldout" if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else "train"].append(doc)
        for split, lst in (("train", train), ("heldout", held)):
            path = out / f"{split}-{name}"  # distinct names: prepare tells sources by name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n\n".join(parts[split]) + "\n", encoding="utf-8")
            lst.append(str(path))
    return train, held


def run_demo(
    out: str | Path,
    vocab_size: int | None = None,
    config: str = "demo",
    sets=(),
    serve: bool = False,
    port: int = 0,
) -> Path:
    """The whole path; `serve` keeps the server up at the end until Ctrl-C (on `port`; 0: a
    free one)."""

    out, vocab_size = Path(out), vocab_size or DEMO_VOCAB
    train_files, heldout = split_sample(out / "text")
    print(f"1/6 tokenizer: {vocab_size} tokens trained on the built-in sample ({train_files})")
    tok_path = train_tokenizer(
        resolve_sources(train_files),
        TokenizerConfig(vocab_size=vocab_size),
        out / "tokenizer",
        progress=False,
    )
    print(f"    wrote {tok_path}\n2/6 fertility on the held-out paragraphs")
    texts = [d for s in resolve_sources(heldout) for d in iter_source(s)]
    print(format_report(str(tok_path), fertility(load_any(tok_path), texts)))
    print(f"3/6 token shards (every {HOLDOUT_EVERY}th paragraph held out as validation)")
    prepare(tok_path, train_files, out / "shards", PrepareConfig(), val=heldout, progress=False)
    cfg = load_config(
        TrainConfig, resolve_config(config), [f"model.vocab_size={vocab_size}", *sets]
    )
    print(
        "4/6 gradient-flow gate, then training (resumes if run before; delete the folder to "
        "start over)"
    )
    final = fit(cfg, out / "shards", out / "run")
    print("5/6 evaluation on the held-out paragraphs against the random twin and compressors")
    result = evaluate_checkpoint(
        final, {"bn": heldout[:1], "en": heldout[1:]}, seq_len=cfg.seq_len, max_new_tokens=30
    )
    print(format_eval(result))

    print(f"6/6 curves: {plot_run(out / 'run')}")
    print(f"done: the model in Hugging Face layout is {final}")
    chat = chat_demo(final, out / "chat", config, sets)
    bundle = export_demo(final, out / "bundle-int4", heldout)
    # The chat model gets a bundle of its own: the completion stays the base model's (what the
    # tests check of it), the chat exchange is the chat model's.
    chat_bundle = export_demo(chat, out / "bundle-chat-int4", heldout) if bundle else None
    gguf_demo(final, out / "gguf")
    gguf_demo(chat, out / "gguf-chat", chat=True)
    if bundle is not None:
        serve_demo(bundle, keep=serve and chat_bundle is None, port=port)
    if chat_bundle is not None:
        serve_demo(chat_bundle, keep=serve, port=port, ask=chat_exchange)
    return final


def chat_demo(final: Path, out: Path, config: str, sets=()) -> Path:
    """A few steps of `doel-train sft` from the pre-trained model on the built-in conversations;
    returns the chat model's folder (its tokenizer_config.json carries the chat template)."""
    data = SAMPLE_DIR / "chat.jsonl"
    asked = [a for kv in [*sets, *CHAT_SETS] for a in ("--set", kv)]  # the command it runs:
    run = ["--config", config, "--from", final, "--data", data, "--out", out, *asked]
    print(f"chat: doel-train sft {shlex.join(map(str, run))} (loss on the replies only)")
    cfg = load_config(SFTConfig, resolve_config(config), [*sets, *CHAT_SETS])
    chat = sft(cfg, [str(data)], final, out)
    print(f"    the chat model is {chat}")
    return chat


def export_demo(final: Path, bundle: Path, heldout: list[str]) -> Path | None:
    """After training: the int4 bundle that serving runs, with its size and parity figures (the
    loss increase measured on the held-out paragraphs)."""
    print(f"export: int4 bundle for serving and phones -> {bundle}")
    try:
        from doel.export.bundle import ExportOptions, export_checkpoint, summary

        opts = ExportOptions(
            quant="int4",
            mobile=True,
            force=True,
            texts=tuple(heldout),
            log=lambda m: print(f"    {m}"),
        )
        manifest = export_checkpoint(final, bundle, opts)
    except ModuleNotFoundError as e:  # a machine with the train extra only
        print(f"    skipped: it needs {e.name!r}: pip install 'doel[export]'")
        return None
    print(summary(bundle, manifest))
    return bundle


def gguf_demo(final: Path, out: Path, chat: bool = False) -> Path | None:
    """The model as a GGUF beside its int4 bundle (f16: the tiny model's file is small, and its
    greedy text stays doel-serve's) and the llama.cpp command that runs it; for the chat model
    also the two Ollama commands (its Modelfile's TEMPLATE holds the chat prompt). Skipped, in
    one line, without the export extra or on a tokenizer llama.cpp cannot run (--style doel)."""
    print(f"export: GGUF for llama.cpp, Ollama and LM Studio -> {out}")
    try:
        from doel.export.common import ExportError
        from doel.export.gguf import export_gguf
    except ModuleNotFoundError as e:
        print(f"    skipped: it needs {e.name!r}: pip install 'doel[export]'")
        return None
    try:
        manifest = export_gguf(final, out, "f16", force=True, log=lambda m: print(f"    {m}"))
    except ExportError as e:
        print(f"    skipped: {e}")
        return None
    path = out / manifest["gguf"]
    if not chat:
        print(f'llama.cpp: llama-cli -m {path} -p "{DEMO_REQUEST["prompt"]}" -n 40')
        return path
    question = DEMO_CHAT["messages"][-1]["content"]
    print(f"llama.cpp: llama-cli -m {path} --jinja  # a chat, in the GGUF's template")
    print(f"ollama: ollama create doel-chat -f {out / 'Modelfile'}")
    print(f'ollama: ollama run doel-chat "{question}"')
    return path


def serve_demo(bundle: Path, keep: bool = False, port: int = 0, ask=None) -> dict | None:
    """The bundle served on 127.0.0.1 (uvicorn in a thread of this process), one request over
    HTTP printed (`ask(url)`; default: a Bangla completion); then a clean shutdown, or with
    `keep` the playground's URL and serving until Ctrl-C. Returns the answer's JSON body."""
    try:
        import uvicorn

        from doel.serve.edge.app import Settings, create_app
    except ModuleNotFoundError as e:  # a machine without the serve extra
        print(f"serve: skipped: it needs {e.name!r}: pip install 'doel[serve]'")
        return None
    app = create_app(Settings(bundle=str(bundle)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="doel-serve", daemon=True)
    thread.start()
    body = None
    try:
        url = _wait_ready(server, thread)
        print(f"serve: {bundle} at {url} (what `doel-serve {bundle}` runs)")
        body = (ask or completion)(url)
        if keep:
            print(f"playground: {url}/ (serving until Ctrl-C)", flush=True)
            while thread.is_alive():
                thread.join(0.5)
        else:  # no address: it is dead once the demo ends
            print(f"playground: `doel-serve {bundle}` serves it (or the demo with --serve)")
    except KeyboardInterrupt:
        print("\nserve: stopped")
    finally:
        server.should_exit = True  # uvicorn's own graceful shutdown, lifespan end included
        thread.join(timeout=15)
    return body


def completion(url: str) -> dict:
    """One Bangla completion over HTTP, printed."""
    body = _post(f"{url}/v1/completions", DEMO_REQUEST)
    usage, choice = body["usage"], body["choices"][0]
    print(f"    POST /v1/completions {json.dumps(DEMO_REQUEST, ensure_ascii=False)}")
    print(f"    {DEMO_REQUEST['prompt']}{choice['text']}")
    print(
        f"    ({usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion "
        f"tokens, finish_reason {choice['finish_reason']})"
    )
    return body


def chat_exchange(url: str) -> dict:
    """One chat turn with the served chat model over HTTP, as an OpenAI client sends it."""
    body = _post(f"{url}/v1/chat/completions", DEMO_CHAT)
    choice, usage = body["choices"][0], body["usage"]
    print(f"    POST /v1/chat/completions {json.dumps(DEMO_CHAT, ensure_ascii=False)}")
    print(f"    user: {DEMO_CHAT['messages'][-1]['content']}")
    print(f"    assistant: {choice['message']['content']}")
    print(
        f"    ({usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion "
        f"tokens, finish_reason {choice['finish_reason']})"
    )
    return body


def _health(url: str) -> tuple[int | None, str]:
    """/health's status and error message; no status while the port is not open yet."""
    try:
        with NO_PROXY.open(f"{url}/health", timeout=5) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:  # 503: loading, or the load failed
        with e:
            return e.code, json.loads(e.read() or b"{}").get("error", {}).get("message", "")
    except OSError:
        return None, ""


def _wait_ready(server, thread: threading.Thread) -> str:
    """The server's URL once it listens and /health says 200."""

    end = time.monotonic() + READY_SECONDS
    while time.monotonic() < end:
        if not thread.is_alive():
            raise DoelError("the demo's server stopped while starting; its log is above")
        if server.started:
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
            status, message = _health(url)
            if status == 200:
                return url
            if message.startswith("loading the model failed"):
                raise DoelError(f"serving {url}: {message}")
        time.sleep(0.05)
    raise DoelError(f"the demo's server was not ready within {READY_SECONDS} s")


def _post(url: str, body: dict) -> dict:
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with NO_PROXY.open(req, timeout=60) as r:
        return json.loads(r.read())
