"""Quantization quality: each quantization's cost in held-out loss, ours against llama.cpp's.

On a trained model, on the same token windows.

The checkpoint (`--model`, a trained Hugging Face folder) is scored in
- PyTorch fp32 (transformers: `export.parity.torch_reference`), the reference;
- doel bundles (`export.bundle.export_checkpoint`, the genai builder's MatMulNBits): int4 at
  block 32, 64 and 128 with the head at 4 bits, at 32, 128 and 256 with it at 8 (the head is
  int8 by default), and int8 at block 128, through `export.runner.OnnxLM`;
- llama.cpp (llama-cpp-python) on GGUF files of the same checkpoint: f32 from the
  `convert_hf_to_gguf.py` shipped in its source, q4_0 and q8_0 quantized from it
  (benchmarks/serve/bench_serve_llama.py's `make_ggufs`). Ids are fed with `Llama.eval`, so
  llama.cpp adds no BOS and never tokenizes; its KV cache is f32, as doel's bundles keep theirs.

Every engine scores the same windows (`export.parity.eval_texts` then `export.runner.windows`,
512 tokens, each from position 0) with the same `export.runner.nll_sum`; increases are per
token and per character (exact NFC character counts), against PyTorch fp32. llama.cpp's f32 file
must match PyTorch within REL_TOL in nats/token on every file, or no result is written: that
proves the windows, ids and model agree. Bits per weight are measured from the files (bytes of
the transformer blocks' linear layers over their weights; the head and embedding separately),
beside the nominal figure of each scheme.

Writes benchmarks/results/quant_quality_small.{json,md}. Run: `make bench-quant-quality`
(`--work DIR` keeps bundles and GGUF files, and a rerun reuses them).
While the file /tmp/doel-quiet exists (another benchmark needs the machine), every heavy step
waits.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common.report import parser, publish
from benchmarks.serve import bench_serve_llama as llama
from benchmarks.serve.bench_serve_engines import load_llama
from doel.export.bundle import MAX_WINDOW, ExportOptions, export_checkpoint
from doel.export.checkpoint import inspect_checkpoint
from doel.export.parity import eval_texts, torch_reference
from doel.export.runner import OnnxLM, bits, score, windows

RESULTS = ("quant_quality_<name>",)

ROOT = Path(__file__).resolve().parents[2]

THREADS = 2
REL_TOL = 1e-3  # llama.cpp f32 vs PyTorch fp32, relative, nats/token
QUIET = Path("/tmp/doel-quiet")
DEFAULT_MODEL = "/tmp/doel-bench-train/doel-steps/final"  # bench_train.py --doel-steps 650
DEFAULT_TEXTS = (
    "../shared/data/bn/bnlp_resources_news_punct/news_test_news.txt",
    "../shared/data/en/gutenberg/pg1342_pride_and_prejudice_austen.txt",
)
# (row, engine, quant, block, head bits, nominal bits per weight: 4 or 8 bits plus one fp32
# scale a block for MatMulNBits; q4_0 / q8_0 hold one fp16 scale per 32 weights)
VARIANTS = [
    ("torch fp32", "torch", "fp32", None, None, 32.0),
    ("doel int4 b32, head int4", "doel", "int4", 32, 4, 5.0),
    ("doel int4 b64, head int4", "doel", "int4", 64, 4, 4.5),
    ("doel int4 b128, head int4", "doel", "int4", 128, 4, 4.25),
    ("doel int4 b32, head int8", "doel", "int4", 32, 8, 5.0),
    ("doel int4 b128, head int8", "doel", "int4", 128, 8, 4.25),
    ("doel int4 b256, head int8", "doel", "int4", 256, 8, 4.125),
    ("doel int8 b128", "doel", "int8", 128, 8, 8.25),
    ("llama.cpp f32", "llama.cpp", "f32", None, None, 32.0),
    ("llama.cpp q4_0", "llama.cpp", "q4_0", 32, None, 4.5),
    ("llama.cpp q8_0", "llama.cpp", "q8_0", 32, None, 8.5),
]


def wait_quiet() -> None:
    """Sleep while another benchmark asks for a quiet machine."""
    if QUIET.exists():
        print(f"{QUIET} exists: waiting ...", flush=True)
    while QUIET.exists():
        time.sleep(15)


# ------------------------------------------------------------------ files


def export_bundles(ckpt: Path, work: Path, variants=None, **options) -> dict[str, Path]:
    """The doel bundles of `variants` (default VARIANTS), exported into `work` (reused where a
    manifest.json is already there); `options`: ExportOptions fields over the ones set here, and
    a variant's seventh item, where it has one, over those."""
    out = {}
    for row, engine, quant, block, head, *more in variants or VARIANTS:
        if engine != "doel":
            continue
        extra = more[1] if len(more) > 1 else {}  # a variant's own ExportOptions fields
        tail = "".join(f"-{k}{v}" for k, v in sorted(extra.items()))
        out[row] = work / f"bundle-{quant}-b{block}-h{head}{tail}"
        if (out[row] / "manifest.json").is_file():
            continue
        wait_quiet()
        print(f"exporting {row} ...", flush=True)
        fields = {"eval_tokens": 64, "force": True, "log": lambda *_: None} | options
        opts = ExportOptions(quant=quant, block_size=block, head_bits=head, **fields | extra)
        export_checkpoint(ckpt, out[row], opts)
    return out


def gguf_files(ckpt: Path, work: Path) -> dict[str, Path]:
    """f32, q4_0 and q8_0 GGUF files. `make_ggufs` quantizes from an f32 file it then deletes,
    so the f32 file kept here is a second conversion of the folder it prepared (gguf-src)."""
    files = {v: work / f"model-{v}.gguf" for v in ("f32", "q4_0", "q8_0")}
    if not (files["q4_0"].is_file() and files["q8_0"].is_file()):
        wait_quiet()
        print("converting to GGUF, quantizing to q4_0 and q8_0 ...", flush=True)
        llama.make_ggufs(ckpt, work, ["q4_0", "q8_0"])
    if not files["f32"].is_file():
        wait_quiet()
        print("converting to GGUF f32 ...", flush=True)
        cmd = [sys.executable, str(llama.converter()), str(work / "gguf-src"), "--outtype", "f32"]
        proc = subprocess.run(
            cmd + ["--outfile", str(files["f32"])], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-3000:]}")
    return files


# ------------------------------------------------------------------ bits per weight


def group(parts: list[tuple[int, int]], kind: str) -> dict:
    """{kind, bytes, weights, bits per weight} of (bytes, weights) pairs."""
    b, n = sum(p[0] for p in parts), sum(p[1] for p in parts)
    return {"type": kind, "bytes": b, "weights": n, "bits_per_weight": 8 * b / n if n else None}


def onnx_weights(model: Path, vocab: int) -> dict:
    """Bytes per weight of a bundle's MatMulNBits layers (data, scales, zero points), the head
    (the one whose N is the vocabulary) apart, and of its embedding table."""
    import onnx
    from onnx import helper

    m = onnx.load(str(model), load_external_data=False)
    size = {}
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        n = int(np.prod(t.dims)) if t.dims else 1
        item = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        size[t.name] = int(ext["length"]) if "length" in ext else n * item
    dims = {t.name: [int(d) for d in t.dims] for t in m.graph.initializer}
    linear, head, emb, emb_ops = [], [], [], set()
    nbits: dict[str, set] = {"linear": set(), "head": set()}
    for node in m.graph.node:
        stored = sum(size.get(i, 0) for i in node.input)
        if node.op_type == "MatMulNBits":
            a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
            part = "head" if a["N"] == vocab else "linear"
            (head if part == "head" else linear).append((stored, a["K"] * a["N"]))
            nbits[part].add(f"int{a['bits']}")
        elif node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in size:
            # the table: fp32 [V, H], or 8-bit [V, H] (one weight a byte) with its scales
            emb.append((stored, int(np.prod(dims[node.input[0]]))))
            emb_ops.add("int8" if node.op_type == "GatherBlockQuantized" else "fp32")
    return {
        "linear": group(linear, "/".join(sorted(nbits["linear"]))),
        "head": group(head, "/".join(sorted(nbits["head"]))),
        "embedding": group(emb, "/".join(sorted(emb_ops))),
    }


def gguf_weights(path: Path) -> dict:
    """The same from a GGUF file: block linears (blk.*, 2-D), head (output.weight, or the tied
    token_embd.weight that serves as both), embedding."""
    tensors = {t.name: t for t in llama.gguf_package().GGUFReader(str(path)).tensors}

    def of(names: list[str]) -> dict:
        kinds = sorted({tensors[n].tensor_type.name for n in names})
        parts = [(int(tensors[n].n_bytes), int(tensors[n].n_elements)) for n in names]
        return group(parts, "/".join(kinds))

    linear = [n for n, t in tensors.items() if n.startswith("blk.") and len(t.shape) > 1]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return {
        "linear": of(linear),
        "head": of([head]) | {"tied_to_embedding": head == "token_embd.weight"},
        "embedding": of(["token_embd.weight"]),
    }


# ------------------------------------------------------------------ scoring


def onnx_logits(bundle: Path, ckpt):
    return OnnxLM(bundle / "model.onnx", ckpt.kv_heads, ckpt.head_dim, threads=THREADS).logits


def llama_logits(path: Path, window: int, kv_type: int):
    """ids [1, T] -> logits [1, T, V] from llama.cpp: the cache cleared, the ids evaluated as
    given (no BOS added), every position's logits kept (logits_all)."""
    llm = load_llama(
        path, THREADS, window + 1, n_batch=window, logits_all=True, type_k=kv_type, type_v=kv_type
    )

    def logits(ids: np.ndarray) -> np.ndarray:
        llm.reset()
        llm.eval(ids[0].tolist())
        return np.array(llm.scores[None, : ids.shape[1]])

    return logits


def score_files(logits_fn, texts: list[dict], window: int) -> tuple[list[np.ndarray], float]:
    """Summed nats of each document (`export.runner.score`), per file, and the seconds taken."""
    wait_quiet()
    t0 = time.perf_counter()
    sums = [np.array([score(logits_fn, [d], window) for d in t["docs"]]) for t in texts]
    return sums, time.perf_counter() - t0


def loss_fields(tokens: int, chars: int, nats: np.ndarray, ref: np.ndarray) -> dict:
    """From per-document nats and the reference's on the same documents. The standard error
    of the increase treats documents as a sample (paired: the reference's own spread cancels)."""
    diff = nats - ref
    se = float(np.sqrt(len(diff)) * diff.std(ddof=1)) if len(diff) > 1 else float("nan")
    return {
        "tokens": tokens,
        "chars": chars,
        "documents": len(diff),
        "nats_per_token": float(nats.sum()) / tokens,
        "bits_per_char": bits(float(nats.sum())) / chars,
        "increase_nats_per_token": float(diff.sum()) / tokens,
        "increase_nats_per_token_se": se / tokens,
        "increase_bits_per_char": bits(float(diff.sum())) / chars,
    }


def losses(sums: list[np.ndarray], ref: list[np.ndarray], texts: list[dict]) -> dict:
    """Per file and over all files: nats/token, bits/char and the increase over `ref`."""
    tokens = [sum(len(d) - 1 for d in t["docs"]) for t in texts]
    chars = [t["chars"] for t in texts]
    files = [
        {"text": t["name"]} | loss_fields(n, c, s, r)
        for t, n, c, s, r in zip(texts, tokens, chars, sums, ref)
    ]
    total = loss_fields(sum(tokens), sum(chars), np.concatenate(sums), np.concatenate(ref))
    return total | {"files": files}


def f32_check(llama_f32: list, torch_fp32: list, f16_kv: list) -> dict:
    """llama.cpp's f32 file against PyTorch fp32, relative difference in nats per file."""
    rel = [abs(a.sum() - b.sum()) / b.sum() for a, b in zip(llama_f32, torch_fp32)]
    rel_f16 = [abs(a.sum() - b.sum()) / b.sum() for a, b in zip(f16_kv, torch_fp32)]
    return {
        "definition": "|llama.cpp f32 - PyTorch fp32| / PyTorch fp32, summed nats of each file",
        "rel_diff_per_file": [float(r) for r in rel],
        "max_rel_diff": float(max(rel)),
        "tolerance": REL_TOL,
        "passed": bool(max(rel) <= REL_TOL),
        "f16_kv_cache_rel_diff_per_file": [float(r) for r in rel_f16],
    }


def run_variants(
    ckpt, texts: list[dict], window: int, bundles: dict, ggufs: dict, variants=None
) -> tuple:
    """Summed nats per file and seconds of every variant, and the f16-KV f32 figures."""
    import llama_cpp

    sums, secs = {}, {}
    for row, engine, quant, *_ in variants or VARIANTS:
        print(f"scoring {row} ...", flush=True)
        if engine == "torch":
            fn = torch_reference(ckpt)
        elif engine == "doel":
            fn = onnx_logits(bundles[row], ckpt)
        else:
            fn = llama_logits(ggufs[quant], window, llama_cpp.GGML_TYPE_F32)
        sums[row], secs[row] = score_files(fn, texts, window)
        del fn
        nats = sum(a.sum() for a in sums[row]) / n_tokens(texts)
        print(f"  {nats:.5f} nats/token, {secs[row]:.0f} s", flush=True)
    print("scoring llama.cpp f32 with its default f16 KV cache ...", flush=True)
    fn = llama_logits(ggufs["f32"], window, llama_cpp.GGML_TYPE_F16)
    f16_kv, _ = score_files(fn, texts, window)
    return sums, secs, f16_kv


def n_tokens(texts: list[dict]) -> int:
    return sum(len(d) - 1 for t in texts for d in t["docs"])


# ------------------------------------------------------------------ report


def rows(sums: dict, secs: dict, texts: list[dict], weights: dict, variants=None) -> list[dict]:
    out = []
    ref = sums["torch fp32"]
    for row, engine, quant, block, head, nominal, *_ in variants or VARIANTS:
        r = {"variant": row, "engine": engine, "quant": quant, "block_size": block}
        r["head_bits"] = head
        r |= {"nominal_bits_per_weight": nominal, "weights": weights.get(row)}
        r |= losses(sums[row], ref, texts) | {"score_s": secs[row]}
        if engine == "llama.cpp":
            own = losses(sums[row], sums["llama.cpp f32"], texts)
            r["increase_vs_llama_f32_nats_per_token"] = own["increase_nats_per_token"]
        out.append(r)
    return out


def bpw(r: dict, part: str) -> str:
    w = (r["weights"] or {}).get(part)
    if not w or w["bits_per_weight"] is None:  # fp32: no quantized layer of that part
        return "32 fp32"
    return f"{w['bits_per_weight']:.2f} {w['type'].lower()}"


def markdown(res: dict) -> str:
    files = [Path(f["text"]).stem for f in res["rows"][0]["files"]]
    head = "| variant | bits/weight: block linears (nominal) | head | embedding | nats/token "
    head += "| Δ nats/token (± SE) | Δ bits/char | "
    head += " | ".join(f"Δ bits/char {f}" for f in files) + " |"
    lines = [
        f"# Quantization quality: `{res['model']}` ({res['date']}, {res['machine']}, commit "
        f"{res['commit']})",
        "",
        res["note"],
        "",
        head,
        "|---|---|---|---|---:|---:|---:|" + "---:|" * len(files),
    ]
    for r in res["rows"]:
        per_file = " | ".join(f"{f['increase_bits_per_char']:+.4f}" for f in r["files"])
        lines.append(
            f"| {r['variant']} | {bpw(r, 'linear')} ({r['nominal_bits_per_weight']:g}) | "
            f"{bpw(r, 'head')} | {bpw(r, 'embedding')} | {r['nats_per_token']:.4f} | "
            f"{r['increase_nats_per_token']:+.4f} (± {r['increase_nats_per_token_se']:.4f}) | "
            f"{r['increase_bits_per_char']:+.4f} | "
            f"{per_file} |"
        )
    c = res["f32_check"]
    lines += [
        "",
        f"Check: llama.cpp f32 against PyTorch fp32 differs by at most {c['max_rel_diff']:.1e} "
        f"relative in nats per file (tolerance {c['tolerance']:.0e}; with llama.cpp's default "
        f"f16 KV cache {max(c['f16_kv_cache_rel_diff_per_file']):.1e}).",
        "",
        f"{res['tokens']:,} tokens ({', '.join(res['tokens_per_file'])}), windows of "
        f"{res['window']} tokens ({res['windows']} forwards), {res['threads']} threads. Δ: over "
        "PyTorch fp32 on the same windows; SE: standard error of the increase over documents "
        f"(paired). Bits/weight measured from the files: bytes of the {res['blocks']} "
        "transformer blocks' linear layers (weights, scales, zero points) over their weights, "
        "the nominal figure in brackets; the head and the embedding table apart (tied in the "
        "checkpoint: llama.cpp keeps one table for both, doel's bundles two). llama.cpp's KV "
        "cache is f32 (doel's bundles: fp32).",
    ]
    return "\n".join(lines) + "\n"


def file_weights(bundles: dict, ggufs: dict, vocab: int) -> dict:
    out = {row: onnx_weights(b / "model.onnx", vocab) for row, b in bundles.items()}
    return out | {f"llama.cpp {v}": gguf_weights(p) for v, p in ggufs.items()}


def resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (ROOT / p).resolve()


def run(args, work: Path) -> dict:
    ckpt = inspect_checkpoint(resolve(args.model))
    paths = [resolve(t) for t in args.text]
    texts = eval_texts(ckpt, paths, args.eval_tokens)
    window = min(ckpt.context_length, MAX_WINDOW)
    bundles = export_bundles(ckpt.folder, work)
    ggufs = gguf_files(ckpt.folder, work)
    sums, secs, f16_kv = run_variants(ckpt, texts, window, bundles, ggufs)
    check = f32_check(sums["llama.cpp f32"], sums["torch fp32"], f16_kv)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    n_windows = sum(len(windows(d, window)) for t in texts for d in t["docs"])
    return {
        "model": str(ckpt.folder),
        "date": date.today().isoformat(),
        "machine": f"{platform.platform()}, {os.cpu_count()} cores",
        "commit": commit,
        "note": "Held-out loss of each quantization against PyTorch fp32, all engines on the "
        "same token windows: doel's MatMulNBits int4 (blocks 32/64/128, the head at 4 or 8 "
        "bits) and int8 (block 128) against llama.cpp's q4_0 and q8_0.",
        "texts": [{"path": str(p), "sha256": t["sha256"]} for p, t in zip(paths, texts)],
        "tokens": n_tokens(texts),
        "tokens_per_file": [f"{t['name']} {n_tokens([t]):,}" for t in texts],
        "window": window,
        "windows": n_windows,
        "threads": THREADS,
        "work": str(work),
        "blocks": ckpt.config["num_hidden_layers"],
        "f32_check": check,
        "rows": rows(sums, secs, texts, file_weights(bundles, ggufs, ckpt.vocab_size)),
        "llama_cpp": llama.llama_info(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="trained checkpoint folder (HF layout)")
    ap.add_argument("--text", nargs="+", default=list(DEFAULT_TEXTS), help="held-out text files")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="split evenly over the files")
    ap.add_argument("--work", help="bundles and GGUF files, kept and reused (default: temporary)")
    ap.add_argument("--name", default="quant_quality_small", help="results file stem")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="ROW",
        help="score only these rows (as the table names them); the two fp32 references always",
    )
    args = ap.parse_args(argv)
    if args.only:
        names = {v[0] for v in VARIANTS}
        if unknown := set(args.only) - names:
            raise SystemExit(f"--only: no row {sorted(unknown)}; rows: {sorted(names)}")
        keep = {*args.only, "torch fp32", "llama.cpp f32"}
        VARIANTS[:] = [v for v in VARIANTS if v[0] in keep]
    if not llama.llama_cpp_available():
        raise SystemExit(
            "llama_cpp is missing: python -m benchmarks.serve.bench_serve --install-llama-cpp"
        )
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_quant_quality_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = run(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(res))
    if not res["f32_check"]["passed"]:
        raise SystemExit(
            f"llama.cpp f32 differs from PyTorch fp32 by {res['f32_check']['max_rel_diff']:.2e} "
            f"(tolerance {REL_TOL:.0e}): the windows or the conversion disagree; nothing written"
        )
    publish(args.out, args.name, res, markdown(res), echo=False)
    print(f"wrote {args.out / args.name}.{{json,md}}")


if __name__ == "__main__":
    main()
