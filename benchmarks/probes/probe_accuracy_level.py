"""Probe: MatMulNBits' accuracy_level on this CPU, batch 1 and batch 8 decode steps at 0.4B.

Decided: the export keeps accuracy_level 4 (benchmarks/results/accuracy_level_0.4b_cpu-<class>.md
per CPU class); kept runnable, not run in CI.

export/graph.py quantizes every linear layer to MatMulNBits with accuracy_level 4 (activations
quantized to int8 inside the kernel: fast where the CPU has VNNI). Issue 22 asks whether that
choice holds on CPUs without it. This probe takes the int4 and int8 bundles bench_serve.py
makes (same random 0.4B model), writes a copy of each graph with another accuracy_level (the
weights are shared, only the attribute changes: 1 = fp32 activations), and times, through
serve/core/engine.py with 8 slots and 2 threads, decode steps of 1 and of 8 rows after a 128-token
prompt in each slot. Also reported: the largest logit difference from level 4 (same weights,
so it is the activations' rounding alone) and the CPU seconds other processes used meanwhile.

Writes benchmarks/results/accuracy_level_0.4b_cpu-<class>.{json,md}. Run:
`python -m benchmarks.probes.probe_accuracy_level --work DIR` (DIR: bench_serve.py's --work folder,
whose bundles are reused; made there if missing), a minute or two on a quiet machine.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from benchmarks.common.report import cpu_line, heading, parser, publish, stamp
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.serve.bench_serve import FULL, THREADS, busy, setup
from doel.serve.core.engine import Engine, read_bundle

RESULTS = ("accuracy_level_0.4b_cpu-<class>",)

LEVELS = (4, 1)  # the default first: the others' logits are compared with it
SLOTS, PROMPT, STEPS = 8, 128, 32


def variant(bundle: Path, level: int, out: Path) -> Path:
    """A copy of `bundle` whose MatMulNBits nodes have `level`: every file copied but the graph,
    rewritten (its external weights stay in the copied data file). Copies, not links: ONNX
    Runtime refuses external data behind a symlink, and onnx.load refuses a data file with
    several hard links (it took the source bundle's file for a hard-link attack afterwards)."""
    import onnx

    out.mkdir(parents=True, exist_ok=True)
    for f in bundle.iterdir():
        if f.name != "model.onnx" and not (out / f.name).exists():
            shutil.copyfile(f, out / f.name)
    m = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    n = 0
    for node in m.graph.node:
        if node.op_type == "MatMulNBits":
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i, n = level, n + 1
    if not n:
        raise SystemExit(f"{bundle} has no MatMulNBits node with an accuracy_level")
    onnx.save(m, str(out / "model.onnx"))
    return out


def time_steps(engine: Engine, rows: int) -> tuple[float, np.ndarray]:
    """Best-of-two mean seconds per decode step of `rows` slots, and the first step's logits."""
    rng = np.random.default_rng(1)
    best, first = float("inf"), None
    for _ in range(2):
        t0 = time.perf_counter()
        for s in range(STEPS):
            logits = engine.decode(rng.integers(16, 2000, rows).tolist(), [PROMPT + s + 1] * rows)
            first = logits if first is None else first
        best = min(best, (time.perf_counter() - t0) / STEPS)
    return best, first


def measure(folder: Path) -> dict:
    engine = Engine(read_bundle(folder), threads=THREADS, slots=SLOTS)
    rng = np.random.default_rng(0)
    for slot in range(SLOTS):
        engine.forward(rng.integers(16, 2000, PROMPT).tolist(), 0, slot=slot)
    one, logits = time_steps(engine, 1)
    eight, _ = time_steps(engine, SLOTS)
    return {"step1_ms": one * 1e3, "step8_ms": eight * 1e3, "logits": logits}


def run(work: Path) -> list[dict]:
    setup(work, FULL, with_llama=False)  # reuses the checkpoint and bundles already there
    rows = []
    for quant in ("int4", "int8"):
        ref = None
        for level in LEVELS:
            folder = variant(work / f"bundle-{quant}", level, work / f"acc-{quant}-{level}")
            print(f"measuring {quant}, accuracy_level {level} ...", flush=True)
            t0 = time.perf_counter()
            res, foreign = foreign_cpu(measure, folder)
            wall = time.perf_counter() - t0
            logits = res.pop("logits")
            ref = logits if ref is None else ref
            rows.append(
                res
                | {
                    "quant": quant,
                    "accuracy_level": level,
                    "tok_s_1": 1e3 / res["step1_ms"],
                    "tok_s_8": SLOTS * 1e3 / res["step8_ms"],
                    "batch8_over_1": SLOTS * res["step1_ms"] / res["step8_ms"],
                    "max_logit_diff_vs_4": float(np.abs(logits - ref).max()),
                    "foreign_cpu_s": foreign,
                    "row_wall_s": wall,
                    "busy": busy(foreign, wall),
                }
            )
    return rows


def markdown(result: dict) -> str:
    lines = [
        *heading("MatMulNBits accuracy_level probe, bangla-0.4b random weights", result),
        f"{cpu_line(result['cpu'])} {THREADS} threads, serve/core/engine.py with {SLOTS} slots, "
        f"each "
        f"holding a {PROMPT}-token prompt; mean of {STEPS} decode steps, best of 2. Level 4: "
        "int8 activations (the export default); 1: fp32 activations; same weights.",
        "",
        "| quant | accuracy_level | step, 1 row (ms) | step, 8 rows (ms) | tok/s, 1 row | "
        "tok/s, 8 rows | 8 rows / 1 row, tok/s | max logit diff vs level 4 | foreign CPU s "
        "(of row s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        flag = " **busy**" if r["busy"] else ""
        lines.append(
            f"| {r['quant']} | {r['accuracy_level']} | {r['step1_ms']:.1f} | "
            f"{r['step8_ms']:.1f} | {r['tok_s_1']:.1f} | {r['tok_s_8']:.1f} | "
            f"{r['batch8_over_1']:.2f} | {r['max_logit_diff_vs_4']:.3g} | "
            f"{r['foreign_cpu_s']:.0f} ({r['row_wall_s']:.0f}){flag} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--work", required=True, help="bench_serve.py's --work folder (reused)")
    args = ap.parse_args(argv)
    result = stamp() | {"rows": run(Path(args.work))}
    name = f"accuracy_level_0.4b_cpu-{result['cpu']['class']}"
    publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
