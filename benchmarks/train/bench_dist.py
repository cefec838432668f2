"""Data-parallel scaling: tokens/s of 1 process against N under torchrun, DDP and FSDP2.

The same global batch for both.

On this machine (2 CPU cores, gloo) it compares 1 process with 2 threads against 2 processes
with 1 thread each: the same cores, so the ratio is the cost of the data-parallel machinery
(gradient all-reduce, FSDP all-gathers), not a speed-up. On a GPU machine,
`--device cuda --nproc 8` measures real scaling (1 GPU against 8, per-GPU batch fixed).

    python -m benchmarks.train.bench_dist [--config small] [--nproc 2] [--steps 30] [--device cpu]

Writes benchmarks/results/dist_<device>.{json,md}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from benchmarks.common.report import heading, machine, parser, publish

RESULTS = ("dist_<device>",)

ROOT = Path(__file__).resolve().parents[2]


def make_shards(work: Path) -> Path:
    """The built-in sample, tokenized at the preset's vocabulary (no external data needed)."""
    from doel.train.data.prepare import PrepareConfig, prepare
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    sample = [str(ROOT / "train" / "sample" / n) for n in ("bn.txt", "en.txt")]
    tok = train_tokenizer(
        resolve_sources(sample), TokenizerConfig(vocab_size=4096), work / "tok", progress=False
    )
    prepare(tok, sample, work / "shards", PrepareConfig(), progress=False, log=lambda *a: None)
    return work / "shards"


def run(work, shards, nproc, strategy, args, rows_per_rank) -> float:
    """Steady-state global tokens/s of one run (steps after the first 3)."""
    out = work / f"run-{nproc}-{strategy}"
    fit = [
        "fit",
        "--config",
        args.config,
        "--data",
        str(shards),
        "--out",
        str(out),
        "--fresh",
        "--steps",
        str(args.steps),
        "--set",
        "log_every=1",
        "--set",
        "eval_every=0",
        "--set",
        "checkpoint_every=0",
        "--set",
        f"batch_size={rows_per_rank}",
        "--set",
        f"strategy={strategy}",
        "--set",
        "model.vocab_size=4096",
        "--set",
        f"device={args.device}",
        "--set",
        "compile=false",
        "--set",
        f"seq_len={args.seq_len}",
    ]
    env = dict(os.environ)
    if nproc == 1:
        cmd = [sys.executable, "-m", "doel.train", *fit]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "train",
            *fit,
        ]
        if args.device == "cpu":  # share the cores out: same hardware as the 1-process run
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // nproc))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if r["kind"] == "train"][3:]
    return sum(speeds) / len(speeds)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--config", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=8, help="rows of the global batch per GPU/rank")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doel-dist-"))
    shards = make_shards(work)
    cpu = args.device == "cpu"
    # CPU: one global batch shared out (same work, same cores). GPU: fixed rows per GPU.
    global_rows = args.rows * args.nproc
    base = run(work, shards, 1, "ddp", args, global_rows if cpu else args.rows)
    result = {
        "date": date.today().isoformat(),
        "device": args.device,
        "nproc": args.nproc,
        "machine": machine(),
        "config": args.config,
        "seq_len": args.seq_len,
        "one_process_tokens_per_s": base,
        "strategies": {},
    }
    for strategy in ("ddp", "fsdp"):
        tps = run(work, shards, args.nproc, strategy, args, args.rows)
        ideal = base if cpu else base * args.nproc
        result["strategies"][strategy] = {"tokens_per_s": tps, "efficiency": tps / ideal}
    lines = heading(
        f"Data-parallel scaling, `{args.config}` preset (vocabulary 4,096), seq {args.seq_len}",
        result | {"machine": f"{result['machine']}, {args.device}"},
    )
    lines += [
        "| run | tokens/s | efficiency |",
        "|---|---:|---:|",
        f"| 1 process | {base:,.0f} | 1.00 |",
    ]
    for s, r in result["strategies"].items():
        lines.append(
            f"| {args.nproc} processes, {s} | {r['tokens_per_s']:,.0f} | {r['efficiency']:.2f} |"
        )
    lines += [
        "",
        "Efficiency: N-process tokens/s over "
        + (
            "the 1-process run on the same cores (1.00 = the data-parallel machinery costs nothing)"
            if cpu
            else "N × the 1-GPU run (1.00 = perfect scaling)"
        )
        + ".",
    ]
    publish(args.out, f"dist_{args.device}", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
