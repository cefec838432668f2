"""Export benchmark at the 0.4B size: fp32 / int8 / int4 bundles against PyTorch eager, same run.

The model is `configs/bangla-0.4b.toml`'s [model] with random weights (the trained model does not
exist yet), saved by `train.hf.save_model` with a tokenizer trained on the built-in sample. Each
precision is exported by `doel-export` in its own process (so its peak memory is its own), then:
- file size, export time (build and total) and peak RSS of the export;
- the parity figures the export wrote into its manifest;
- decode speed: greedy, batch 1, a 128-token prompt then 64 new tokens, 2 threads, best of 2,
  through `export.runner.OnnxLM`, two numpy loops: plain (the graph concatenates the KV cache,
  copying it every step) and shared (one preallocated buffer per layer bound as both past and
  present, what serving should do), against transformers' `generate` in PyTorch eager fp32 with
  its KV cache, in the same process.

With random weights the logits are nearly uniform, so the loss increase and top-1 agreement say
little about a trained model; they show the checks running at full size.

Writes benchmarks/results/export_0.4b_cpu.{json,md}. Run: `make bench-export`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks.common.report import heading, machine, parser, publish

RESULTS = ("export_0.4b_cpu",)

ROOT = Path(__file__).resolve().parents[2]

PROMPT_TOKENS, NEW_TOKENS, THREADS = 128, 64, 2
QUANTS = ("fp32", "int8", "int4")


def machine_busy_s() -> float:
    """CPU seconds spent by every process on the machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def own_cpu_s() -> float:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def foreign_cpu(fn, *args):
    """fn(*args) and the CPU seconds other processes used meanwhile: other jobs on a 2-core
    machine skew speed figures, so each one is reported with this number beside it."""
    busy, own = machine_busy_s(), own_cpu_s()
    result = fn(*args)
    return result, max(0.0, (machine_busy_s() - busy) - (own_cpu_s() - own))


def make_checkpoint(folder: Path, preset: str) -> Path:
    """Random-weight model of a preset in Hugging Face layout, with a sample-trained tokenizer."""
    import torch

    from doel.train.config import load_config
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama
    from doel.train.settings import TrainConfig

    cfg = load_config(TrainConfig, ROOT / "configs" / f"{preset}.toml").model
    sample = [str(p) for p in sorted((ROOT / "train" / "sample").glob("*.txt"))]
    # 4,096 tokens (the sample holds about 2,600 merges), never more than the model's embedding
    # table has rows: the tiny preset's 2,048 (bench_serve.py --quick)
    vocab = TokenizerConfig(vocab_size=min(4096, cfg.vocab_size))
    tok = train_tokenizer(resolve_sources(sample), vocab, folder / "tok", progress=False)
    torch.manual_seed(0)
    model = Llama(cfg)
    print(f"{preset}: {model.num_parameters() / 1e6:.1f}M parameters", flush=True)
    return save_model(model, folder / "ckpt", tokenizer=tok)


def export(ckpt: Path, out: Path, quant: str) -> dict:
    """`doel-export` in its own process; its manifest plus wall time and peak RSS."""
    cmd = [sys.executable, "-m", "doel.export", str(ckpt), "--out", str(out), "--quant", quant]
    cmd += ["--force"] + (["--mobile"] if quant == "int4" else [])
    timed = ["/usr/bin/time", "-f", "PEAK_RSS_KB %M"] if Path("/usr/bin/time").exists() else []
    t0 = time.perf_counter()
    proc = subprocess.run(timed + cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"export {quant} failed:\n{proc.stdout}\n{proc.stderr}")
    rss = re.search(r"PEAK_RSS_KB (\d+)", proc.stderr)
    manifest = json.loads((out / "manifest.json").read_text())
    return {
        "manifest": manifest,
        "wall_s": wall,
        "peak_rss_mb": int(rss.group(1)) / 1024 if rss else None,
    }


def prompt(vocab: int) -> list[int]:
    import numpy as np

    return [0] + np.random.default_rng(0).integers(300, vocab, PROMPT_TOKENS - 1).tolist()


def onnx_decode(bundle: Path, ckpt_cfg: dict, ids: list[int]) -> dict:
    from doel.export.runner import OnnxLM

    kv = ckpt_cfg["num_key_value_heads"]
    head_dim = ckpt_cfg["hidden_size"] // ckpt_cfg["num_attention_heads"]
    results = {}
    loops = [("onnx", "model.onnx", "greedy"), ("onnx_shared", "model.onnx", "greedy_shared")]
    loops.append(("ort_shared", "model.ort", "greedy_shared"))
    for label, name, loop in loops:
        if not (bundle / name).is_file():
            continue
        run = getattr(OnnxLM(bundle / name, kv, head_dim, threads=THREADS), loop)
        run(ids[:8], 4)  # warm-up
        best = max((run(ids, NEW_TOKENS) for _ in range(2)), key=lambda r: r[2])
        results[label] = {"tokens": best[0], "prefill_s": best[1], "decode_tok_s": best[2]}
    return results


def torch_decode(ckpt: Path, ids: list[int]) -> dict:
    """The peer: transformers' generate, PyTorch eager fp32 with its KV cache, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    x = torch.tensor([ids])

    def run(n: int) -> tuple[list[int], float, float]:
        with torch.no_grad():
            t0 = time.perf_counter()
            model(x)  # prefill alone, to report it as the ONNX rows do
            t1 = time.perf_counter()
            out = model.generate(
                x,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                temperature=None,
                top_k=None,
                pad_token_id=2,
            )
            t2 = time.perf_counter()
        # generate's time = one prefill + n - 1 decode steps
        return out[0, len(ids) :].tolist(), t1 - t0, (n - 1) / max(t2 - t1 - (t1 - t0), 1e-9)

    run(4)
    best = max((run(NEW_TOKENS) for _ in range(2)), key=lambda r: r[2])
    return {"tokens": best[0], "prefill_s": best[1], "decode_tok_s": best[2]}


def row(quant: str, ex: dict, speed: dict, torch_tok_s: float, torch_tokens: list[int]) -> dict:
    m, p = ex["manifest"], ex["manifest"]["parity"]
    onnx_bytes = sum(f["bytes"] for n, f in m["files"].items() if n.startswith("model.onnx"))
    r = {
        "quant": quant,
        "engine": m["engine"],
        "onnx_mb": onnx_bytes / 1e6,
        "ort_mb": m["files"]["model.ort"]["bytes"] / 1e6 if "model.ort" in m["files"] else None,
        "build_s": m["timing"]["build_s"],
        "export_total_s": m["timing"]["total_s"],
        "export_wall_s": ex["wall_s"],
        "export_peak_rss_mb": ex["peak_rss_mb"],
        "logits_max_rel_err": p["logits_vs_torch"]["max_rel_err"],
        "top1_agreement": p["logits_vs_torch"]["top1_agreement"],
        "kv_vs_full_max_rel_err": p["kv_cache_vs_full"]["max_rel_err"],
        "loss_increase_nats_per_token": p["loss"]["increase_nats_per_token"],
        "loss_increase_bits_per_char": p["loss"]["increase_bits_per_char"],
        "ort_vs_onnx_max_rel_err": p.get("ort_format_vs_onnx", {}).get("max_rel_err"),
    }
    for key, s in speed.items():
        r[f"{key}_prefill_s"] = s["prefill_s"]
        r[f"{key}_decode_tok_s"] = s["decode_tok_s"]
        r[f"{key}_speedup_vs_torch"] = s["decode_tok_s"] / torch_tok_s
        same = sum(a == b for a, b in zip(s["tokens"], torch_tokens))
        r[f"{key}_greedy_tokens_equal_torch"] = f"{same}/{len(torch_tokens)}"
    return r


def markdown(result: dict) -> str:
    t = result["torch_eager"]
    lines = [
        *heading(f"Export benchmark, {result['preset']} (random weights)", result),
        f"Model: `configs/{result['preset']}.toml` [model], {result['parameters_m']:.1f}M "
        "parameters, "
        f"fp32 safetensors {result['checkpoint_mb']:.0f} MB. Decode: greedy, batch 1, "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, {THREADS} threads, best of 2; "
        "ONNX through numpy loops (`export.runner.OnnxLM`).",
        "",
        f"PyTorch eager fp32 (transformers `generate`, KV cache): prefill {t['prefill_s']:.2f} s, "
        f"decode **{t['decode_tok_s']:.1f} tokens/s**.",
        "",
        "| quant | engine | model.onnx MB | export s (build / total) | peak RSS MB | logits max "
        "rel err vs torch | top-1 agree | KV vs full | loss increase nats/token (bits/char) | "
        "prefill s | decode tok/s, plain loop | decode tok/s, shared KV buffer | vs PyTorch "
        "eager (shared) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['quant']} | {r['engine']} | {r['onnx_mb']:.0f} | {r['build_s']:.1f} / "
            f"{r['export_total_s']:.1f} | {r['export_peak_rss_mb'] or 0:.0f} | "
            f"{r['logits_max_rel_err']:.2e} | {r['top1_agreement']:.3f} | "
            f"{r['kv_vs_full_max_rel_err']:.1e} | {r['loss_increase_nats_per_token']:+.4f} "
            f"({r['loss_increase_bits_per_char']:+.4f}) | {r['onnx_prefill_s']:.2f} | "
            f"{r['onnx_decode_tok_s']:.1f} | **{r['onnx_shared_decode_tok_s']:.1f}** | "
            f"{r['onnx_shared_speedup_vs_torch']:.2f}× |"
        )
    for r in result["rows"]:
        if r.get("ort_mb"):
            lines += [
                "",
                f"ORT format ({r['quant']}, `--mobile`): model.ort {r['ort_mb']:.0f} MB, max rel "
                f"err vs the ONNX model {r['ort_vs_onnx_max_rel_err']:.1e}, decode "
                f"{r['ort_shared_decode_tok_s']:.1f} tokens/s on this x86 machine (shared KV "
                "buffer).",
            ]
    foreign = ", ".join(
        f"{r['quant']} export {r['export_foreign_cpu_s']:.0f} s / decode "
        f"{r['decode_foreign_cpu_s']:.0f} s"
        for r in result["rows"]
    )
    lines += [
        "",
        f"CPU seconds used by other processes meanwhile (2 cores; 0 is a quiet machine): PyTorch "
        f"decode {t['foreign_cpu_s']:.0f} s; {foreign}.",
        "",
        "Random weights make the logits nearly uniform: the loss increase and top-1 agreement "
        "here show the checks running at full size, not the quality of a trained model.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = parser(__doc__, work="scratch folder (default: a temporary one, deleted)")
    ap.add_argument("--preset", default="bangla-0.4b", help="model preset (tiny: a smoke run)")
    ap.add_argument("--reuse", action="store_true", help="reuse --work's bundles: decode only")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_export_"))
    try:
        saved = work / "exports.json"
        if args.reuse and saved.is_file():  # measure decoding again on the same bundles
            ckpt, exports = work / "ckpt", json.loads(saved.read_text())
        else:
            ckpt, exports = make_checkpoint(work, args.preset), {}
            for quant in QUANTS:
                print(f"exporting {quant} ...", flush=True)
                made, foreign = foreign_cpu(export, ckpt, work / f"bundle-{quant}", quant)
                exports[quant] = made | {"foreign_cpu_s": foreign}
            saved.write_text(json.dumps(exports))
        cfg = json.loads((ckpt / "config.json").read_text())
        ids = prompt(cfg["vocab_size"])
        print("decoding with PyTorch eager ...", flush=True)
        peer, peer_foreign = foreign_cpu(torch_decode, ckpt, ids)
        peer["foreign_cpu_s"] = peer_foreign
        rows = []
        for quant in QUANTS:
            print(f"decoding {quant} ...", flush=True)
            speed, foreign = foreign_cpu(onnx_decode, work / f"bundle-{quant}", cfg, ids)
            r = row(quant, exports[quant], speed, peer["decode_tok_s"], peer["tokens"])
            rows.append(r | {"export_foreign_cpu_s": exports[quant]["foreign_cpu_s"]})
            rows[-1]["decode_foreign_cpu_s"] = foreign
        n_params = (ckpt / "model.safetensors").stat().st_size / 4 / 1e6  # fp32 weights
        result = {
            "date": date.today().isoformat(),
            "machine": machine(python=True),
            "preset": args.preset,
            "parameters_m": n_params,
            "checkpoint_mb": (ckpt / "model.safetensors").stat().st_size / 1e6,
            "torch_eager": {k: v for k, v in peer.items() if k != "tokens"},
            "rows": rows,
        }
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    name = "export_0.4b_cpu" if args.preset == "bangla-0.4b" else f"export_{args.preset}_cpu"
    publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
