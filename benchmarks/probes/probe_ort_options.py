"""Probe: ONNX Runtime's own session options against the batched decode step (issue 22).

Decided: serve's engine keeps ONNX Runtime's defaults (2 intra-op threads, spinning on), since
none of the options moves the ceiling of 8 streams over one
(benchmarks/results/ort_options_0.4b_cpu-<class>.md); kept runnable, not run in CI.

Issue 22 asks for fixes through ONNX Runtime's own options before any kernel of ours. This probe
times, for each option below, on the int4 and int8 bundles bench_serve.py makes (random 0.4B,
2 threads, serve/core/engine.py with 8 slots each holding a 128-token prompt): a 128-token prefill
(P), a decode step of 1 row (t1) and of 8 rows (t8), and from them the ceiling of 8 streams over
one that no scheduling can pass (profile_serve.ratio_ceiling). Every option runs in PROCESSES
processes of its own, best of each (a process's memory reads run faster or slower for its whole
life), and its first 8-row logits are compared with the default's (same inputs): an option
that changes the results is not a speed option.

Writes benchmarks/results/ort_options_0.4b_cpu-<class>.{json,md}. Run:
`python -m benchmarks.probes.probe_ort_options --work DIR` (bench_serve.py's --work folder; its
bundles are reused, made there if missing): a few minutes on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks.common import report
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.serve.bench_serve import FULL, THREADS, busy, setup
from benchmarks.serve.profile_serve import ratio_ceiling
from doel.serve.core.engine import Engine, read_bundle

RESULTS = ("ort_options_0.4b_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]

# label -> (session config entries, what the option changes); the default first
OPTIONS = {
    "default": ({}, "the engine's settings (2 intra-op threads, spinning on)"),
    "value cache BNHS": (
        {"session.gqa_value_layout": "BNHS"},
        "GroupQueryAttention's value cache with the positions last (the engine allocates it so)",
    ),
    "LUT GEMM": ({"mlas.use_lut_gemm": "1"}, "MatMulNBits through lookup tables"),
    "dynamic blocks 4": (
        {"session.dynamic_block_base": "4"},
        "parallel loops split into shrinking blocks, not fixed ones",
    ),
    "no spinning": (
        {"session.intra_op.allow_spinning": "0"},
        "the worker thread sleeps between parallel regions",
    ),
    "worker pinned": (
        {"session.intra_op_thread_affinities": "2"},
        "the intra-op worker thread pinned to the second core",
    ),
}
SLOTS, PROMPT, STEPS, PROCESSES = 8, 128, 32, 4


def measure(bundle: Path, config: dict[str, str]) -> dict:
    """P, t1 and t8 in ms (best of 3 timings each) and the first 8-row step's logits."""
    e = Engine(read_bundle(bundle), threads=THREADS, slots=SLOTS, session_config=config)
    e.warm_up()
    rng = np.random.default_rng(0)
    prefill = []
    for slot in range(SLOTS):
        t0 = time.perf_counter()
        e.forward(rng.integers(16, 2000, PROMPT).tolist(), 0, slot=slot)
        prefill.append(time.perf_counter() - t0)
    out = {"prefill_ms": min(prefill[1:]) * 1e3}
    tokens = np.random.default_rng(1).integers(16, 2000, (STEPS, SLOTS)).tolist()
    for rows in (1, SLOTS):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for s in range(STEPS):
                logits = e.decode(tokens[s][:rows], [PROMPT + s + 1] * rows)
                if s == 0 and rows == SLOTS and "logits" not in out:
                    out["logits"] = logits
            best = min(best, (time.perf_counter() - t0) / STEPS)
        out[f"step{rows}_ms"] = best * 1e3
    return out


def one_process(bundle: str, label: str, logits_out: str) -> dict:
    """In a process of its own: one option's timings; its first 8-row logits go to a .npy file."""
    t0 = time.perf_counter()
    res, foreign = foreign_cpu(measure, Path(bundle), OPTIONS[label][0])
    np.save(logits_out, res.pop("logits"))
    return res | {"foreign_cpu_s": foreign, "wall_s": time.perf_counter() - t0}


def best_of(runs: list[dict]) -> dict:
    """The fastest figure of each kind over the processes, the slowest beside it (the spread
    between processes), and their busiest foreign CPU."""
    keys = ("prefill_ms", "step1_ms", f"step{SLOTS}_ms")
    best = {k: min(r[k] for r in runs) for k in keys}
    worst = {f"{k}_worst": max(r[k] for r in runs) for k in keys}
    return (
        best
        | worst
        | {
            "processes": len(runs),
            "foreign_cpu_s": max(r["foreign_cpu_s"] for r in runs),
            "busy": any(busy(r["foreign_cpu_s"], r["wall_s"]) for r in runs),
            "ratio_ceiling": ratio_ceiling(best["prefill_ms"], best["step1_ms"], best["step8_ms"]),
        }
    )


def stream_tok_s(p: float, t1: float, t8: float, new: int = 128) -> tuple[float, float]:
    """Tokens/s of one stream alone and of eight at best (ratio_ceiling's two sides)."""
    return new / (p + (new - 1) * t1) * 1e3, SLOTS * new / (SLOTS * p + (new - 1) * t8) * 1e3


def one(bundle: Path, label: str, logits: Path) -> dict:
    cmd = report.command("probes.probe_ort_options", "--one", bundle, label, logits)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{bundle.name} / {label} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def run(work: Path) -> list[dict]:
    """Every option once a round, PROCESSES rounds: the machine's drift over the minutes of the
    probe falls on every option alike, not on the ones measured last."""
    setup(work, FULL, with_llama=False)  # reuses the checkpoint and bundles already there
    rows = []
    for quant in ("int4", "int8"):
        bundle = work / f"bundle-{quant}"
        runs = {label: [] for label in OPTIONS}
        for i in range(PROCESSES):
            for label in OPTIONS:
                print(f"{quant}, {label}, process {i + 1} of {PROCESSES} ...", flush=True)
                runs[label].append(one(bundle, label, work / f"ort-option-{quant}-{label}.npy"))
        ref = np.load(work / f"ort-option-{quant}-default.npy")
        for label, got in runs.items():
            diff = float(np.abs(np.load(work / f"ort-option-{quant}-{label}.npy") - ref).max())
            rows.append(best_of(got) | {"quant": quant, "option": label, "max_logit_diff": diff})
    return rows


def markdown(result: dict) -> str:
    title = (
        "ONNX Runtime's session options against the batched decode step, bangla-0.4b random weights"
    )
    lines = [
        *report.heading(title, result),
        f"{report.cpu_line(result['cpu'])} onnxruntime {result['onnxruntime']}, {THREADS} threads, "
        f"serve/core/engine.py with {SLOTS} slots, each holding a {PROMPT}-token prompt; steps are "
        f"the mean of {STEPS}, best of 3, and every figure the best of {PROCESSES} processes, "
        "the options taking turns. Ceiling: "
        "8 streams / 1 with these P, t1 and t8 (128-token prompts, 128 new tokens), whatever the "
        "scheduling; tokens/s: one stream's and eight streams' at best with them. An option that "
        "lifts the ceiling by slowing one stream serves nobody faster.",
        "",
        "| quant | option | session config | P ms | t1 ms | t8 ms | ceiling of 8 streams / 1 "
        "| tokens/s, 1 / 8 streams | slowest process: P / t1 / t8 ms | max logit diff vs "
        "default | foreign CPU s |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        config = ", ".join(f"`{k}={v}`" for k, v in OPTIONS[r["option"]][0].items()) or "–"
        flag = " **busy**" if r["busy"] else ""
        one, eight = stream_tok_s(r["prefill_ms"], r["step1_ms"], r[f"step{SLOTS}_ms"])
        lines.append(
            f"| {r['quant']} | {r['option']} | {config} | {r['prefill_ms']:.0f} | "
            f"{r['step1_ms']:.2f} | {r['step8_ms']:.2f} | {r['ratio_ceiling']:.2f} | "
            f"{one:.0f} / {eight:.0f} | {r['prefill_ms_worst']:.0f} / "
            f"{r['step1_ms_worst']:.2f} / {r['step8_ms_worst']:.2f} | "
            f"{r['max_logit_diff']:.3g} | {r['foreign_cpu_s']:.1f}{flag} |"
        )
    lines += ["", "What each option changes:", ""]
    lines += [f"- {label}: {why}." for label, (_, why) in OPTIONS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__, work=report.SERVE_WORK_HELP)
    ap.add_argument(
        "--one", nargs=3, metavar=("BUNDLE", "OPTION", "LOGITS"), help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_process(*args.one)))
        return
    import onnxruntime

    work = Path(args.work or report.SERVE_WORK)
    result = report.stamp() | {"onnxruntime": onnxruntime.__version__, "rows": run(work)}
    result["machine_load"] = report.load_line()
    name = f"ort_options_0.4b_cpu-{result['cpu']['class']}"
    report.publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
