"""Whether a base model's completion ends where its document ends, in every runtime it is run in.

`doel-train prepare` writes each document as `<|bos|> text <|eos|>` (train/data/shards.py), so a
base model says "this document is over" by predicting <|eos|>: the token generation_config.json
(transformers, optimum), the GGUF (llama.cpp), genai_config.json (onnxruntime-genai), the
Modelfile (Ollama) and doel-serve already stop at. Before, documents were only separated by
<|bos|>, which no runtime treats as an end (nanochat's own engine stops at a sampled BOS for
that reason; the runtimes people install do not).

A tiny model is trained here for a few seconds on prepare's shards of short documents that each
end the same way ("... গান গায়।", "... songs."), then exported as an ONNX bundle and a GGUF. Each
runtime completes a prompt of such a document greedily with room for 24 more tokens: it is ok
when that runtime itself ends the completion before the limit ("stop"), with the text ending as
the document does and no special token in it (onnxruntime-genai's text: its own decoding of the
ids before the one it stopped at). Rows from `rows(work)`; `python -m
benchmarks.runtimes.end_of_document` prints them as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.load.load_servers import BINARY
from benchmarks.runtimes.genai import GENAI_VENV
from benchmarks.runtimes.llama_server import LlamaServer, llama_version

ORTGENAI_PYTHON = GENAI_VENV  # the interpreter with onnxruntime-genai 0.18
DIGITS = "০১২৩৪৫৬৭৮৯"
# A prompt, and how the document it begins ends (the number may grow a digit first).
PROMPTS = {"ডোয়েল পাখি ৭ বার গান": "গায়।", "The bird sang 12": "songs."}
MAX_NEW = 24  # room to go well past the document's end
STEPS = 200  # training steps: about five seconds on one core


def _bn(i: int) -> str:
    return "".join(DIGITS[int(c)] for c in str(i))


def documents() -> list[str]:
    """Short documents, distinct (prepare drops duplicates) and each ending the same way."""
    bn = [f"ডোয়েল পাখি {_bn(i)} বার গান গায়।" for i in range(300)]
    return bn + [f"The bird sang {i} songs." for i in range(300)]


def build(work: Path, steps: int = STEPS) -> dict:
    """Tokenizer (the default spm style), shards, a trained tiny model, its checkpoint, an fp32
    ONNX bundle and an f32 GGUF with its Modelfile, in `work`; their paths."""
    import torch

    from doel.train.data.prepare import prepare
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, smallest_vocab, train_tokenizer
    from doel.train.hf import save_model

    work.mkdir(parents=True, exist_ok=True)
    data = work / "docs.txt"
    data.write_text("\n".join(documents()) + "\n", encoding="utf-8")
    vocab = -(-(smallest_vocab("spm") + 64) // 64) * 64
    cfg = TokenizerConfig(vocab_size=vocab, min_frequency=1)  # style: the default
    tok = train_tokenizer(resolve_sources([str(data)]), cfg, work / "tok", progress=False)
    prepare(tok, [str(data)], work / "shards", progress=False, log=lambda _m: None)
    torch.manual_seed(0)
    model = _train(work / "shards", vocab, steps)
    ckpt = save_model(model, work / "ckpt", tokenizer=tok)
    return {"tokenizer": tok, "shards": work / "shards", "checkpoint": ckpt} | _export(ckpt, work)


def build_before(work: Path, built: dict, steps: int = STEPS) -> Path:
    """The control: the same documents laid out as prepare wrote them before (shard version 1,
    `<|bos|> text` with no <|eos|>), the same training, an fp32 bundle; its folder."""
    import numpy as np
    import torch

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.data.shards import ShardWriter, open_shard
    from doel.train.hf import save_model

    new = json.loads((built["shards"] / "meta.json").read_text(encoding="utf-8"))
    (work / "shards").mkdir(parents=True, exist_ok=True)
    for split, info in new["splits"].items():
        w = ShardWriter(work / "shards", split, new["tokenizer"]["vocab_size"],
                        new["tokenizer"]["bos_id"], 1 << 30)  # fmt: skip
        for s in info["shards"]:
            h, ids = open_shard(built["shards"] / s["file"])
            ids = np.asarray(ids[ids != h.eos_id])
            starts = np.flatnonzero(ids == h.bos_id)
            w.add(ids, np.diff(np.append(starts, len(ids))))
        info["shards"] = w.close()
    new["format"] |= {"version": 1, "document": "<|bos|> text"}
    (work / "shards" / "meta.json").write_text(json.dumps(new), encoding="utf-8")
    torch.manual_seed(0)
    model = _train(work / "shards", new["tokenizer"]["vocab_size"], steps)
    ckpt = save_model(model, work / "ckpt", tokenizer=built["tokenizer"])
    opts = ExportOptions(quant="fp32", eval_tokens=64, log=lambda _m: None)
    export_checkpoint(ckpt, work / "bundle", opts)
    return work / "bundle"


def _train(shards: Path, vocab: int, steps: int):
    import torch

    from doel.train.data.loader import TokenLoader
    from doel.train.model import Llama, ModelConfig

    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True)  # fmt: skip
    model, loader = Llama(cfg), TokenLoader(shards, batch_size=16, seq_len=64, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x, y = (torch.from_numpy(a) for a in loader.next_batch())
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _export(ckpt: Path, work: Path) -> dict:
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.gguf import export_gguf

    quiet = lambda _m: None  # noqa: E731
    bundle, gguf_dir = work / "bundle", work / "gguf"
    export_checkpoint(ckpt, bundle, ExportOptions(quant="fp32", eval_tokens=64, log=quiet))
    export_gguf(ckpt, gguf_dir, quant="f32", log=quiet)
    return {"bundle": bundle, "gguf": next(gguf_dir.glob("*.gguf")), "gguf_dir": gguf_dir}


# ------------------------------------------------------------------ the runtimes


def doel_serve(bundle: Path, prompt: str) -> dict:
    """POST /v1/completions to doel-serve's app (FastAPI's TestClient, lifespan included)."""
    from fastapi.testclient import TestClient

    from doel.serve.edge.app import Settings, create_app

    with TestClient(create_app(Settings(bundle=str(bundle), threads=1))) as c:
        end = time.monotonic() + 60
        while c.get("/health").status_code != 200 and time.monotonic() < end:
            time.sleep(0.05)
        body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
        r = c.post("/v1/completions", json=body).json()
    choice = r["choices"][0]
    return {"text": choice["text"], "finish": choice["finish_reason"],
            "tokens": r["usage"]["completion_tokens"]}  # fmt: skip


def transformers_generate(ckpt: Path, prompt: str) -> dict:
    """transformers' generate() on the checkpoint, greedy: it stops at generation_config.json's
    eos_token_id or runs to max_new_tokens."""
    from transformers import AutoModelForCausalLM

    return _generate(AutoModelForCausalLM.from_pretrained(ckpt), ckpt, prompt)


def optimum_generate(bundle: Path, prompt: str) -> dict:
    """optimum's ORTModelForCausalLM on the ONNX bundle, greedy (its generation_config.json)."""
    from optimum.onnxruntime import ORTModelForCausalLM

    return _generate(ORTModelForCausalLM.from_pretrained(bundle), bundle, prompt)


def _generate(model, folder: Path, prompt: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False)
    new = out[0, ids.input_ids.shape[1] :].tolist()
    stopped = len(new) < MAX_NEW and new[-1] == model.generation_config.eos_token_id
    new = new[:-1] if stopped else new  # the text before the id it stopped at
    return {"text": tok.decode(new), "finish": "stop" if stopped else "length",
            "tokens": len(new) + stopped}  # fmt: skip


def llama_server(gguf: Path, prompt: str, log: Path) -> dict:
    """llama-server (llama.cpp) on the GGUF: POST /v1/completions, greedy."""
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
    with LlamaServer(gguf, log) as server:
        r = server.json("/v1/completions", body)
    choice = r["choices"][0]
    return {"text": choice["text"], "finish": choice["finish_reason"],
            "tokens": r["usage"]["completion_tokens"]}  # fmt: skip


GENAI_SCRIPT = """
import json, sys
import onnxruntime_genai as og
bundle, prompt, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = og.Model(bundle)
tok = og.Tokenizer(model)
ids = list(tok.encode(prompt))
p = og.GeneratorParams(model)
p.set_search_options(do_sample=False, max_length=len(ids) + max_new)
g = og.Generator(model, p)
g.append_tokens(ids)
new = []
while not g.is_done():
    g.generate_next_token()
    new.append(int(g.get_next_tokens()[0]))
texts = [tok.decode(new), tok.decode(new[:-1])]
print(json.dumps({"new": new, "texts": texts, "version": og.__version__}))
"""


def genai(bundle: Path, prompt: str) -> dict:
    """onnxruntime-genai (its own venv, 0.18) on the bundle: its Tokenizer and Generator,
    greedy; it ends at genai_config.json's eos_token_id or at max_length."""
    cmd = [str(ORTGENAI_PYTHON), "-c", GENAI_SCRIPT, str(bundle), prompt, str(MAX_NEW)]
    env = os.environ | {"PYTHONIOENCODING": "utf-8"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    eos = json.loads((bundle / "genai_config.json").read_text())["model"]["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    new = r["new"]
    stopped = len(new) < MAX_NEW and new[-1] in eos
    text = r["texts"][1] if stopped else r["texts"][0]  # without the id it stopped at
    return {"text": text, "finish": "stop" if stopped else "length", "tokens": len(new),
            "version": r["version"]}  # fmt: skip


def web_export(ckpt: Path, work: Path) -> Path:
    """The checkpoint at int4 with --web (the page's default path: doel's kernel on the int4
    weights); the bundle's folder, its page in BUNDLE/web."""
    from doel.export.bundle import ExportOptions, export_checkpoint

    out = work / "bundle-int4-web"
    # A model trained for seconds to end its documents: what int4 adds to its held-out loss
    # depends on the CPU's kernels (0.21 nats/token on amd-avx512-vnni, over the default 0.1)
    # and says nothing of the format, which bench_quant_quality measures on a trained model.
    opts = ExportOptions(
        quant="int4", web=True, eval_tokens=64, max_loss_increase=1.0, log=lambda _m: None
    )
    export_checkpoint(ckpt, out, opts)
    return out


def chromium_version() -> str | None:
    """Chromium's version ("156.0.7456.0"), or None where it or chromedriver is missing."""
    from benchmarks.web.bench_web import CHROMIUM, DRIVER

    if not (Path(CHROMIUM).is_file() and Path(DRIVER).is_file()):
        return None
    out = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.split()[1]  # "Chromium 156.0.7456.0 built on Debian ..."


@contextmanager
def opened_page(bundle: Path):
    """BUNDLE/web on a loopback static server, loaded in headless Chromium as a visitor gets it
    (its default path): (the driver, the page's facts); both closed at the end."""
    import threading

    from benchmarks.web.bench_web import browser, settled
    from doel.export.web import static_server

    server = static_server(bundle / "web")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = browser()
    try:
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        facts = settled(driver, "doel.ready", fail=False)
        if "error" in facts:
            raise RuntimeError(f"the page did not load: {facts['error']}")
        yield driver, facts
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


def browser_page(bundle: Path, prompts, stop_ids: list[int] | None = None) -> dict:
    """Each prompt completed greedily in the opened page by its own doel.generate() (its stop
    ids: web.json's, or `stop_ids`): {"facts": the page's, prompt: {"text", "finish", "tokens",
    "ids"}}; "tokens" leaves out the id it stopped at, as doel-serve's usage does."""
    from benchmarks.web.bench_web import settled

    with opened_page(bundle) as (driver, facts):
        out = {"facts": facts}
        for prompt in prompts:
            req = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            if stop_ids is not None:
                req["stop_ids"] = stop_ids
            r = settled(driver, "doel.generate(arguments[0])", req, fail=False)
            if "error" in r:
                raise RuntimeError(f"the page failed on {prompt!r}: {r['error']}")
            out[prompt] = {"text": r["text"], "finish": r["reason"], "ids": r["ids"],
                           "tokens": len(r["ids"])}  # fmt: skip
    return out


def modelfile_stops(gguf_dir: Path) -> list[str]:
    """The `PARAMETER stop` values of the Modelfile as written (Ollama stops at each)."""
    lines = (gguf_dir / "Modelfile").read_text(encoding="utf-8").splitlines()
    return [json.loads(ln.split(None, 2)[2]) for ln in lines if ln.startswith("PARAMETER stop ")]


# ------------------------------------------------------------------ rows


def _verdict(r: dict, ending: str) -> tuple[str, bool]:
    text = r["text"]
    ok = r["finish"] == "stop" and r["tokens"] < MAX_NEW
    ok = ok and text.endswith(ending) and "<|" not in text
    return f"{r['finish']} after {r['tokens']} token(s), text {r['text']!r}", ok


def _runtime_rows(name: str, version: str, run) -> list[dict]:
    out = []
    for prompt, ending in PROMPTS.items():
        try:
            result, ok = _verdict(run(prompt), ending)
        except Exception as e:  # the runtime failed: a row that says how
            result, ok = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", False
        check = f"greedy completion of {prompt!r} (max {MAX_NEW}) ends at the document's end"
        out.append({"runtime": name, "version": version, "check": check, "result": result,
                    "ok": ok})  # fmt: skip
    return out


def _missing(name: str, why: str) -> dict:
    return {"runtime": name, "version": "-", "check": "stops at the end of a document",
            "result": f"not run: {why}", "ok": False}  # fmt: skip


def rows(work: Path) -> list[dict]:
    import transformers

    import doel

    work = Path(work)
    built = build(work)
    eos = json.loads((built["checkpoint"] / "generation_config.json").read_text())["eos_token_id"]
    out = _runtime_rows("doel-serve", doel.__version__, lambda p: doel_serve(built["bundle"], p))
    out += _runtime_rows(
        "transformers generate()",
        transformers.__version__,
        lambda p: transformers_generate(built["checkpoint"], p),
    )
    try:
        import optimum.version

        run = lambda p: optimum_generate(built["bundle"], p)  # noqa: E731
        out += _runtime_rows("optimum ORTModelForCausalLM", optimum.version.__version__, run)
    except ImportError:
        out.append(_missing("optimum ORTModelForCausalLM", "optimum is not installed"))
    if BINARY.is_file():
        log = work / "llama-server.log"
        run = lambda p: llama_server(built["gguf"], p, log)  # noqa: E731
        out += _runtime_rows("llama-server (llama.cpp)", llama_version(), run)
    else:
        out.append(_missing("llama-server (llama.cpp)", f"{BINARY} not built"))
    if ORTGENAI_PYTHON.is_file():
        seen = {}

        def run(p):
            seen.update(r := genai(built["bundle"], p))
            return r

        found = _runtime_rows("onnxruntime-genai", "?", run)
        out += [r | {"version": seen.get("version", "?")} for r in found]
    else:
        out.append(_missing("onnxruntime-genai", f"{ORTGENAI_PYTHON} missing"))
    chromium = chromium_version()
    if chromium:
        page, name = {}, "the browser page (doel-export --web, int4, its default path)"

        def run(p):
            if not page:  # one browser for every prompt
                page["bundle"] = web_export(built["checkpoint"], work)
                page.update(browser_page(page["bundle"], PROMPTS))
            return page[p]

        out += _runtime_rows(name, f"Chromium {chromium}", run)
        for p in PROMPTS if "bundle" in page else ():
            serve = doel_serve(page["bundle"], p)["text"]
            out.append({"runtime": name, "version": f"Chromium {chromium}",
                        "check": f"its text for {p!r} is doel-serve's on the same int4 bundle",
                        "result": f"page {page[p]['text']!r}, doel-serve {serve!r}",
                        "ok": page[p]["text"] == serve})  # fmt: skip
    else:
        out.append(_missing("the browser page (doel-export --web)", "no Chromium"))
    before = build_before(work / "before", built)
    check = "control: the same model trained on documents without <|eos|> (shard version 1)"
    r = doel_serve(before, next(iter(PROMPTS)))
    out.append({"runtime": "doel-serve", "version": doel.__version__, "check": check,
                "result": _verdict(r, "")[0], "ok": r["finish"] == "length"})  # fmt: skip
    stops = modelfile_stops(built["gguf_dir"])
    tok = json.loads(built["tokenizer"].read_text(encoding="utf-8"))
    eos_text = next(t["content"] for t in tok["added_tokens"] if t["id"] == eos)
    out.append({"runtime": "Ollama (Modelfile as written)", "version": "-",
                "check": "the Modelfile's PARAMETER stop holds the token the model ends with",
                "result": f"stops {stops}; the model ends documents with {eos_text!r}",
                "ok": eos_text in stops})  # fmt: skip
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)), indent=1,
                         ensure_ascii=False))  # fmt: skip
