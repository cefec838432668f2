"""What structured output costs: decode tokens/s with a JSON schema against without.

Issue 35: at 1 and 8 streams, and one stream without a format beside 7 with one, on the 0.4B
shape (int4 bundle as bench_serve builds it; doel's spm tokenizer at 32,768 tokens,
probe_grammar's). Writes
benchmarks/results/structured_0.4b_cpu-<class>.{json,md}.

In-process (doel.serve.core.service.Service, 8 slots, 2 threads, greedy): every stream's token times
are recorded, and the rate is counted over the window where all of a run's streams decode (after
the last one's first token, before the first one's last), so prefill is left out. The schema is a
long list of records (an enum with Bangla values, a short string, an integer), long enough that
every stream runs to max_tokens. Modes run interleaved, in rounds, in several processes; each
mode's best run counts (the CPU is shared).

    flock /tmp/doel-bench.lock python -m benchmarks.serve.bench_structured
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path

RESULTS = ("structured_0.4b_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]
PRESET = "bangla-0.4b"
SCHEMA = {
    "type": "array",
    "minItems": 200,  # never complete within max_tokens: every stream decodes as long
    "items": {
        "type": "object",
        "properties": {
            "city": {"enum": ["ঢাকা", "চট্টগ্রাম", "খুলনা", "রাজশাহী", "Sylhet"]},
            "name": {"type": "string", "maxLength": 16},
            "n": {"type": "integer"},
        },
        "required": ["city", "name", "n"],
        "additionalProperties": False,
    },
}
# mode: formats of the 8 or 1 streams (True: with the schema)
MODES = {
    "1 plain": [False],
    "1 schema": [True],
    "8 plain": [False] * 8,
    "8 schema": [True] * 8,
    "1 plain + 7 schema": [False] + [True] * 7,
    "8 schema, masks on the scheduler's thread": [True] * 8,
}
SERIAL = "8 schema, masks on the scheduler's thread"  # the masks computed before the step
TARGETS = [  # (name, (mode, metric) over (mode, metric), at least)
    ("8 streams: tokens/s with a schema / without", ("8 schema", "all"), ("8 plain", "all"), 0.90),
    ("a stream without a format: beside 7 with one / beside 7 without",
     ("1 plain + 7 schema", "plain_stream"), ("8 plain", "plain_stream"), 0.98),
    ("1 stream: tokens/s with a schema / without", ("1 schema", "all"), ("1 plain", "all"), 0.90),
]  # fmt: skip


def serial_masks(constraints) -> Future:
    """scheduler.fill_all without its thread: every mask computed before the model step."""
    for c in constraints:
        c.fill()
    done: Future = Future()
    done.set_result(None)
    return done


def bundle(work: Path) -> Path:
    """The 0.4B preset's random-weight checkpoint with doel's spm tokenizer at 32,768 tokens,
    exported int4 as bench_serve does (kept in `work`)."""
    from benchmarks.probes.probe_grammar import spm_tokenizer
    from benchmarks.serve.bench_serve import export_bundle

    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        import torch

        from doel.train.config import load_config
        from doel.train.hf import save_model
        from doel.train.model import Llama
        from doel.train.settings import TrainConfig

        tok = spm_tokenizer(ROOT.parent / "shared" / "data", work, 30_000_000).parent
        cfg = load_config(TrainConfig, ROOT / "configs" / f"{PRESET}.toml").model
        torch.manual_seed(0)
        save_model(Llama(cfg), ckpt, tokenizer=tok)
    print("exporting int4 ...", flush=True)
    return export_bundle(ckpt, work / "bundle-int4", "int4", 64)


async def stream(svc, fmt, prompt: list[int], max_tokens: int) -> list[float]:
    """One stream's token arrival times."""
    from doel.serve.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    times = []
    async for _ in svc.scheduler.generate(prompt, params, constraint=fmt and fmt.start()):
        times.append(time.perf_counter())
    return times


def rate(runs: list[list[float]], counted: list[list[float]] | None = None) -> float:
    """Tokens per second of the `counted` streams (default: all) over the window where all of
    `runs` decode."""
    start, end = max(r[0] for r in runs), min(r[-1] for r in runs)
    tokens = sum(sum(start < t <= end for t in r) for r in counted or runs)
    return tokens / (end - start)


def child(path: str, rounds: int, max_tokens: int) -> dict:
    """In a process of its own: every mode once per round; each mode's runs."""
    from doel.serve.core import scheduler
    from doel.serve.core.service import Service

    svc = Service.load(path, threads=2, slots=8)
    fmt = svc.grammars.json_schema(SCHEMA)
    prompt = svc.encode("নিচের তালিকাটি JSON-এ লেখো: শহর, নাম, সংখ্যা।")
    out: dict[str, list[dict]] = {m: [] for m in MODES}

    async def run(flags):
        return await asyncio.gather(
            *(stream(svc, fmt if f else None, prompt, max_tokens) for f in flags)
        )

    asyncio.run(run([True]))  # warm: the first masks, the first steps
    for _ in range(rounds):
        for mode, flags in MODES.items():
            parallel = scheduler.fill_all
            scheduler.fill_all = serial_masks if mode == SERIAL else parallel
            try:
                runs = asyncio.run(run(flags))
            finally:
                scheduler.fill_all = parallel
            plain = [r for r, f in zip(runs, flags) if not f]
            row = {"all": rate(runs), "per_stream": rate(runs) / len(runs)}
            if plain:
                row["plain_stream"] = rate(runs, plain) / len(plain)
            out[mode].append(row)
    return out


def best(processes: list[dict]) -> dict[str, dict[str, float]]:
    """Each mode's best value of each metric over every run of every process."""
    out: dict[str, dict[str, float]] = {}
    for proc in processes:
        for mode, runs in proc.items():
            for row in runs:
                for k, v in row.items():
                    out.setdefault(mode, {})[k] = max(out.get(mode, {}).get(k, 0.0), v)
    return out


def verdicts(rates: dict) -> list[dict]:
    out = []
    for name, (m1, k1), (m2, k2), floor in TARGETS:
        value = rates[m1][k1] / rates[m2][k2]
        out.append({"target": name, "value": round(value, 4), "at_least": floor,
                    "met": value >= floor})  # fmt: skip
    return out


def report(r: dict) -> str:
    lines = [
        "# Structured output's cost (issue 35)",
        "",
        f"{r['cpu']['model_name']} ({r['cpu']['class']}), {r['cores']} cores, 2 threads; load "
        f"{r['load_start']:.1f} → {r['load_end']:.1f}. The {PRESET} preset (random weights), int4 "
        f"bundle, doel's spm tokenizer at 32,768 tokens; greedy, {r['max_tokens']} new tokens a "
        f"stream; best of {r['rounds']} rounds × {r['processes']} processes. Schema: a list of "
        "records (a Bangla enum, a string, an integer) too long to finish. Masks computed "
        "on a thread of their own while the model runs (serve/core/structured.py); the last mode "
        "computes them on the scheduler's thread before the step, for comparison.",
        "",
        "| mode | tokens/s, all streams | per stream | a stream without a format |",
        "|---|---:|---:|---:|",
    ]
    for mode, row in r["rates"].items():
        plain = f"{row['plain_stream']:.2f}" if "plain_stream" in row else ""
        lines.append(f"| {mode} | {row['all']:.2f} | {row['per_stream']:.2f} | {plain} |")
    lines += ["", "| target | value | at least | verdict |", "|---|---:|---:|---|"]
    for v in r["verdicts"]:
        verdict = "met" if v["met"] else "**not met**"
        lines.append(f"| {v['target']} | {v['value']:.3f} | {v['at_least']} | {verdict} |")
    par, ser = r["rates"]["8 schema"]["all"], r["rates"][SERIAL]["all"]
    lines += [
        "",
        f"8 streams with a schema, masks computed beside the model step: {par:.2f} tokens/s; "
        f"on the scheduler's thread before it: {ser:.2f} ({par / ser:.3f}×).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help="(internal) measure this bundle, print JSON")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every mode per process")
    ap.add_argument("--processes", type=int, default=2, help="processes, one after the other")
    ap.add_argument("--max-tokens", type=int, default=96, help="new tokens per stream")
    work = Path.home() / ".cache" / "doel" / "bench-structured"
    ap.add_argument("--work", default=str(work), help="where the checkpoint and bundle are kept")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.max_tokens)))
        return
    from benchmarks.common.cpu_class import this_cpu
    from benchmarks.common.report import publish

    path = bundle(Path(args.work))
    load_start, processes = os.getloadavg()[0], []
    for i in range(args.processes):
        cmd = [sys.executable, "-m", "benchmarks.serve.bench_structured", "--child", str(path)]
        cmd += ["--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"process {i} failed:\n{proc.stderr[-3000:]}")
        processes.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"process {i + 1} of {args.processes} done", flush=True)
    rates = best(processes)
    cpu = this_cpu()
    r = {
        "cpu": cpu, "cores": os.cpu_count(), "load_start": load_start,
        "load_end": os.getloadavg()[0], "preset": PRESET, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "processes": args.processes, "schema": SCHEMA, "rates": rates,
        "runs": processes, "verdicts": verdicts(rates),
    }  # fmt: skip
    out = publish(args.out, f"structured_0.4b_cpu-{cpu['class']}", r, report(r), echo=False)
    print(report(r))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
