"""GGUF benchmark: what the llama.cpp-compatible tokenizer costs, and llama.cpp's parity.

On ../shared/data: the cost of the tokenizer style, and proof that llama.cpp runs doel's GGUF
export as doel does.

1. Cost: tokenizers of the "doel" and the "gguf" style (`doel-train tokenizer --style gguf`),
   trained on the same few MB of the train split of splits.json (Bangla 55 % of the
   characters), at each vocabulary size asked; characters/token on the validation split, per
   language, and the gguf style's change against doel's.
2. Proof (when llama-cpp-python is installed: benchmarks/serve/bench_serve_llama.py builds
   it): a random Llama on the gguf tokenizer exported with `doel-export --format gguf --quant
   f32`; llama.cpp tokenizes every held-out line, Bangla and English, and its ids are
   compared with `tokenizers`' id for id; llama.cpp's f32 logits on a held-out prompt against
   PyTorch's.

3. Quantization (`--quant-model CKPT`, a trained checkpoint on a gguf tokenizer): held-out loss
   of this export's q8_0 and q4_0 GGUF files in llama.cpp beside doel's int8 and int4 bundles
   (defaults) in ONNX Runtime, each against PyTorch fp32 on the same token windows
   (benchmarks/export/bench_quant_quality.py's machinery; llama.cpp's KV cache f32).

Writes benchmarks/results/gguf.{json,md}. Run: `python -m benchmarks.export.bench_gguf` (then
`--proof-only` / `--quant-model CKPT` add their parts to the same files).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import doel.train.data.tokenizer as tokmod
from benchmarks.common.report import parser, publish
from benchmarks.train.bench_tokenizer import language_weights, measure
from doel.train.data.fertility import load_any
from doel.train.data.textio import iter_source, resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

RESULTS = ("gguf",)

ROOT = Path(__file__).resolve().parents[2]


def machine() -> dict:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }


# Where the gguf style's cost comes from: each of its two differences from doel alone, over
# characters with byte fallback (benchmark-only styles, patched in for the run).
ABLATIONS = {
    "qwen35 split, NFC": ("qwen35", False, True),
    "doel split, no NFC": ("doel", False, False),
}


@contextlib.contextmanager
def ablation_style(name: str):
    """TokenizerConfig(style=name) trains one of ABLATIONS for the block."""
    pattern, byte_level, nfc = ABLATIONS[name]
    saved = tokmod.normalizers.NFC
    tokmod.STYLES[name] = (pattern, byte_level)
    if not nfc:
        tokmod.normalizers.NFC = lambda: tokmod.normalizers.Sequence([])
    try:
        yield
    finally:
        tokmod.normalizers.NFC = saved
        del tokmod.STYLES[name]


def cost(sources, weights, val, sizes: list[int], max_chars: int, work: Path, ablate: bool) -> dict:
    """chars/token of both styles at each size, and the gguf style's relative change."""
    out = {}
    for size in sizes:
        row = {}
        styles = ["doel", "gguf"] + (list(ABLATIONS) if ablate else [])
        for i, style in enumerate(styles):
            t = time.perf_counter()
            with ablation_style(style) if style in ABLATIONS else contextlib.nullcontext():
                cfg = TokenizerConfig(vocab_size=size, style=style, max_chars=max_chars)
                path = train_tokenizer(sources, cfg, work / f"{i}-{size}", weights, progress=False)
            row[style] = measure(load_any(path), val) | {
                "train_seconds": round(time.perf_counter() - t, 1),
                "path": str(path),
            }
        for lang in ("bn", "en"):
            a = row["doel"][lang]["chars_per_token"]
            for style in styles[1:]:
                row[style][f"{lang}_change"] = row[style][lang]["chars_per_token"] / a - 1
            row[f"{lang}_change"] = row["gguf"][f"{lang}_change"]
        out[str(size)] = row
        print(
            f"{size}: bn doel {row['doel']['bn']['chars_per_token']:.3f} gguf "
            f"{row['gguf']['bn']['chars_per_token']:.3f} ({row['bn_change']:+.2%}); en "
            f"{row['doel']['en']['chars_per_token']:.3f} gguf "
            f"{row['gguf']['en']['chars_per_token']:.3f} ({row['en_change']:+.2%})",
            flush=True,
        )
    return out


def proof(tok_path: Path, lines: dict[str, list[str]], work: Path) -> dict:
    """llama.cpp against tokenizers on every held-out line, and f32 logits against PyTorch."""
    import llama_cpp
    import numpy as np
    import torch

    from doel.export.gguf import export_gguf
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    tok = load_tokenizer(tok_path)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    ckpt = save_model(model, work / "ckpt", tokenizer=tok_path)
    export_gguf(ckpt, work / "gguf", "f32", force=True, log=lambda _m: None)
    llm = llama_cpp.Llama(  # type_k/type_v 0: an f32 KV cache (llama.cpp's default is f16)
        str(work / "gguf" / "model-f32.gguf"),
        n_ctx=512,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
    )
    out = {}
    for lang, texts in lines.items():
        same = tokens = 0
        first_diff = None
        for text in texts:
            ours = tok.encode(text).ids
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
            tokens += len(ours)
            if ours == theirs:
                same += 1
            elif first_diff is None:
                first_diff = text[:200]
        out[lang] = {"lines": len(texts), "identical": same, "tokens": tokens, "first": first_diff}
    prompt = tok.encode(lines["bn"][0] + "\n" + lines["en"][0]).ids[:512]
    llm.reset()
    llm.eval(prompt)
    got = np.array(llm.scores[: len(prompt)], dtype=np.float64)
    with torch.no_grad():
        ref = model(torch.tensor([prompt]))[0].double().numpy()
    out["logits"] = {
        "positions": len(prompt),
        "max_abs_error": float(np.abs(got - ref).max()),
        "max_abs_logit": float(np.abs(ref).max()),
        "relative": float(np.abs(got - ref).max() / np.abs(ref).max()),
        "bound": 1e-4,
    }
    out["llama_cpp"] = llama_cpp.__version__
    return out


QUANT_ROWS = [  # (row, engine, quant)
    ("PyTorch fp32", "torch", "fp32"),
    # the export's defaults (doel.contracts.quant: block, head bits, rounding) as they are now
    ("doel int8 (the export's default)", "doel", "int8"),
    ("doel int4 (the export's default)", "doel", "int4"),
    ("llama.cpp f32 (this export)", "llama.cpp", "f32"),
    ("llama.cpp q8_0 (this export)", "llama.cpp", "q8_0"),
    ("llama.cpp q4_0 (this export, embedding q8_0)", "llama.cpp", "q4_0"),
]


def quant_losses(model: Path, texts: list[Path], eval_tokens: int, work: Path) -> dict:
    """Held-out loss of every QUANT_ROWS variant against PyTorch fp32, same windows."""
    import llama_cpp

    from benchmarks.export import bench_quant_quality as bq
    from doel.export.bundle import MAX_WINDOW, ExportOptions, export_checkpoint
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.gguf import export_gguf
    from doel.export.parity import eval_texts, torch_reference

    ckpt = inspect_checkpoint(model)
    docs = eval_texts(ckpt, texts, eval_tokens)
    window = min(ckpt.context_length, MAX_WINDOW)
    sums, secs, files = {}, {}, {}
    for row, engine, quant in QUANT_ROWS:
        print(f"scoring {row} ...", flush=True)
        if engine == "torch":
            fn = torch_reference(ckpt)
        elif engine == "doel":
            out = work / f"bundle-{quant}"
            opts = ExportOptions(quant=quant, eval_tokens=64, force=True, log=lambda *_: None)
            export_checkpoint(ckpt.folder, out, opts)
            files[row] = sum(p.stat().st_size for p in out.glob("model.onnx*"))
            fn = bq.onnx_logits(out, ckpt)
        else:
            out = work / f"gguf-{quant}"
            export_gguf(ckpt.folder, out, quant, force=True, log=lambda _m: None)
            files[row] = (out / f"model-{quant}.gguf").stat().st_size
            fn = bq.llama_logits(out / f"model-{quant}.gguf", window, llama_cpp.GGML_TYPE_F32)
        sums[row], secs[row] = bq.score_files(fn, docs, window)
        del fn
    ref = sums["PyTorch fp32"]
    rows = []
    for row, engine, quant in QUANT_ROWS:
        loss = bq.losses(sums[row], ref, docs)
        loss.pop("files")
        rows.append({"variant": row, "engine": engine, "quant": quant, "bytes": files.get(row)})
        rows[-1] |= loss | {"score_s": round(secs[row], 1)}
    return {
        "model": str(ckpt.folder),
        "texts": [str(t) for t in texts],
        "tokens": bq.n_tokens(docs),
        "window": window,
        "rows": rows,
    }


def parity_table(p: dict) -> list[str]:
    """The proof's table: each held-out set's texts, how many gave identical ids, tokens."""
    out = ["| held-out | texts | identical ids | tokens |", "|---|---:|---:|---:|"]
    for lang in [k for k in p if k not in ("logits", "llama_cpp")]:
        q = p[lang]
        out.append(f"| {lang} | {q['lines']:,} | {q['identical']:,} | {q['tokens']:,} |")
    return out


def markdown(r: dict) -> str:
    m = r["machine"]
    out = [
        f"# GGUF tokenizer cost and llama.cpp parity ({r['date']})",
        "",
        f"{m['cpu']}, {m['cores']} cores, load average {m['load_average_1_5_15']} (shared "
        f"machine), Python {m['python']}. Tokenizers trained on the first "
        f"{r['max_chars']:,} characters of the train split of `../shared/data/splits.json` "
        f"(Bangla {r['bangla_share']:.0%}), measured on its validation split (Bengali-script "
        "text of the bn files, Latin-script text of the en files).",
        "",
        "| vocab | bn doel | bn gguf | bn change | en doel | en gguf | en change |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, row in r["cost"].items():
        d, g = row["doel"], row["gguf"]
        out.append(
            f"| {int(size):,} | {d['bn']['chars_per_token']:.3f} | {g['bn']['chars_per_token']:.3f}"
            f" | {row['bn_change']:+.2%} | {d['en']['chars_per_token']:.3f} | "
            f"{g['en']['chars_per_token']:.3f} | {row['en_change']:+.2%} |"
        )
    out += ["", "Characters per token; change = gguf / doel - 1 (negative: more tokens)."]
    ab = [(size, name, row[name]) for size, row in r["cost"].items() for name in ABLATIONS
          if name in row]  # fmt: skip
    if ab:
        out += ["", "Each difference alone, over characters with byte fallback:", ""]
        out += ["| vocab | tokenizer | bn chars/token | bn change | en chars/token | en change |"]
        out += ["|---:|---|---:|---:|---:|---:|"]
        for size, name, x in ab:
            out.append(
                f"| {int(size):,} | {name} | {x['bn']['chars_per_token']:.3f} | "
                f"{x['bn_change']:+.2%} | {x['en']['chars_per_token']:.3f} | "
                f"{x['en_change']:+.2%} |"
            )
    p = r.get("proof")
    if p:
        size = f"{int(max(r['cost'], key=int)):,}"
        out += [
            "",
            f"llama.cpp (llama-cpp-python {p['llama_cpp']}) against `tokenizers` on the "
            f"{size}-token gguf tokenizer above (a random 2-layer Llama on it, exported with "
            "`--format gguf --quant f32`), on every held-out line and on blocks of 20 lines "
            "(newlines and blank lines included):",
            "",
        ]
        out += parity_table(p)
        lg = p["logits"]
        out += [
            "",
            f"f32 logits on a {lg['positions']}-token held-out prompt: max |llama.cpp - PyTorch| "
            f"= {lg['max_abs_error']:.2e}, {lg['relative']:.2e} of the largest logit (bound "
            f"{lg['bound']:.0e}: {'ok' if lg['relative'] <= lg['bound'] else 'over'}).",
        ]
    else:
        out += ["", "llama.cpp parity: not run (llama-cpp-python not installed)."]
    q = r.get("quant")
    if q:
        out += [
            "",
            f"Held-out loss of `{Path(q['model']).parent.name}/{Path(q['model']).name}` (a model "
            f"trained on the 8,192-token gguf tokenizer), {q['tokens']:,} tokens of "
            f"{', '.join(Path(t).name for t in q['texts'])} in {q['window']}-token windows, "
            "every engine on the same windows, against PyTorch fp32:",
            "",
            "| variant | nats/token | increase (nats/token) | ± s.e. | weights file (MB) |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in q["rows"]:
            size = f"{row['bytes'] / 1e6:.1f}" if row["bytes"] else ""
            out.append(
                f"| {row['variant']} | {row['nats_per_token']:.4f} | "
                f"{row['increase_nats_per_token']:+.4f} | "
                f"{row['increase_nats_per_token_se']:.4f} | {size} |"
            )
        if q.get("note"):
            out += ["", q["note"]]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--vocab-size", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--max-chars", type=int, default=6_000_000, help="training characters")
    ap.add_argument("--bangla-share", type=float, default=0.55)
    ap.add_argument("--quant-model", help="a trained checkpoint on a gguf tokenizer (part 3)")
    ap.add_argument("--quant-text", nargs="+", help="held-out files (default: validation)")
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--quant-note", help="a sentence on the model, printed under its table")
    ap.add_argument("--ablations", action="store_true", help="also each difference alone")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench-gguf"))
    ap.add_argument(
        "--proof-only",
        action="store_true",
        help="keep the cost rows of OUT/gguf.json (their tokenizers still in --work) and run "
        "only the llama.cpp parity",
    )
    args = ap.parse_args()
    data = Path(args.data)
    if not (data / "splits.json").is_file():
        sys.exit(f"no {data}/splits.json: point --data at the shared data folder")
    splits = json.loads((data / "splits.json").read_text())
    sources = resolve_sources(
        [str(data / p) for p in splits["bn"]["train"] + splits["en"]["train"]]
    )
    weights = language_weights(sources, len(splits["bn"]["train"]), args.bangla_share)
    val = {
        lang: [
            d
            for s in resolve_sources([str(data / p) for p in splits[lang]["validation"]])
            for d in iter_source(s)
        ]
        for lang in ("bn", "en")
    }
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    if args.quant_model:
        report = json.loads((out / "gguf.json").read_text())
        report["quant_machine"] = machine()
        texts = args.quant_text or []
        for lang in () if texts else ("bn", "en"):  # the first validation file, as .txt
            src = data / splits[lang]["validation"][0]
            texts.append(str(work / f"heldout_{lang}_{src.stem}.txt"))
            Path(texts[-1]).write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
        report["quant"] = quant_losses(
            Path(args.quant_model), [Path(t) for t in texts], args.eval_tokens, work / "quant"
        )
        report["quant"]["note"] = args.quant_note
        publish(out, "gguf", report, markdown(report))
        return
    if args.proof_only:
        report = json.loads((out / "gguf.json").read_text())
        report["proof_machine"] = machine()
    else:
        report = {
            "date": date.today().isoformat(),
            "machine": machine(),
            "max_chars": args.max_chars,
            "bangla_share": args.bangla_share,
            "cost": cost(
                sources, weights, val, args.vocab_size, args.max_chars, work, args.ablations
            ),
        }
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: parity not run", flush=True)
    else:
        largest = report["cost"][max(report["cost"], key=int)]["gguf"]["path"]
        lines = {
            lang: [ln for d in docs for ln in d.splitlines() if ln.strip()]
            for lang, docs in val.items()
        }
        for lang in ("bn", "en"):  # newlines and blank lines too: blocks of 20 lines
            raw = [ln for d in val[lang] for ln in d.split("\n")]
            lines[f"{lang}, blocks of 20 lines"] = [
                "\n".join(raw[i : i + 20]) for i in range(0, len(raw), 20)
            ]
        report["proof"] = proof(Path(largest), lines, work / "proof")
        print(json.dumps({k: v for k, v in report["proof"].items()}, indent=1), flush=True)
    report.setdefault("machine_after", machine()["load_average_1_5_15"])
    publish(out, "gguf", report, markdown(report))


if __name__ == "__main__":
    main()
