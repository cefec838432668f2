"""A held conversation's cache parked outside the running streams' span, or not.

A conversation that ends between running streams: its held cache inside their steps' span,
parked outside it or not (serve/core/scheduler.py's `_park`, serve/core/prefix.py's `parking`).

On the int4 bundle bench_serve.py makes (random 0.4B, 2 threads, 4 slots as a small chat
server), measured in one process, the two ways taking turns ROUNDS times:
- the engine alone: a decode step of slots 0-2, slot 1 idle, its placeholder row attending over
  the 1,536 held positions (not parked) or over one (parked);
- the scheduler: streams A and C (128-token prompts, 128 new tokens) and B (a 1,536-token
  conversation, 8 new tokens) arrive together and take slots 0-2; once B ends, A's and C's ids
  per second to their end, then B's next turn's time to first token (its prefix found where
  it was left, slot 1, or where it was parked).
Greedy throughout; the ids of A and C are compared between the two ways.

Writes benchmarks/results/held_prefix_0.4b_cpu-<class>.{json,md}. Run:
`python -m benchmarks.serve.bench_held_prefix --work DIR` (bench_serve.py's --work folder; its
bundles are reused, made there if missing): about a minute on a quiet machine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from benchmarks.common import report
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.serve.bench_serve import FULL, THREADS, setup
from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.prefix import Hit
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.scheduler import Scheduler

RESULTS = ("held_prefix_0.4b_cpu-<class>",)

SLOTS, SHORT, LONG, NEW, LONG_NEW, ROUNDS, STEPS = 4, 128, 1536, 128, 8, 3, 32
WAYS = ("held in the span", "parked")


def step_ms(e: Engine, hole_total: int) -> float:
    """Best of 3: mean ms of a step of slots 0-2 whose slot 1 is a placeholder of that length."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(STEPS):
            e.decode([17, 0, 17], [SHORT + 1 + i, hole_total, SHORT + 1 + i])
        best = min(best, (time.perf_counter() - t0) / STEPS)
    return best * 1e3


async def streams(s: Scheduler, prompts: list[list[int]]) -> dict:
    """A, B and C together; A's and C's ids per second after B's end; B's next turn."""

    async def run(prompt, n, hit=None):
        params = SamplingParams(max_tokens=n, temperature=0.0)
        ids, times = [], []
        async for t in s.generate(prompt, params, hit=hit):
            ids.append(t)
            times.append(time.perf_counter())
        return ids, times

    (a, ta), (b, tb), (c, tc) = await asyncio.gather(
        run(prompts[0], NEW), run(prompts[1], LONG_NEW), run(prompts[2], NEW)
    )
    end = tb[-1]
    after = sum(t > end for t in ta + tc)
    rate = after / (max(ta[-1], tc[-1]) - end)
    hit, t0 = Hit(), time.perf_counter()
    turn = prompts[1] + b + prompts[3]
    _, tt = await run(turn, 1, hit)
    return {"ids": [a, c], "after_tok_s": rate, "turn2_ttft_s": tt[0] - t0, "cached": hit.tokens}


def measure(bundle: Path) -> dict:
    e = Engine(read_bundle(bundle), threads=THREADS, slots=SLOTS)
    e.warm_up()
    rng = np.random.default_rng(0)
    for slot, n in ((0, SHORT), (1, LONG), (2, SHORT)):
        e.forward(rng.integers(16, 2000, n).tolist(), 0, slot=slot)
    steps = {w: [] for w in WAYS}
    copies = []
    for _ in range(ROUNDS):
        steps[WAYS[0]].append(step_ms(e, LONG + 1))
        steps[WAYS[1]].append(step_ms(e, 1))
        t0 = time.perf_counter()
        e.copy_slot(1, 3, LONG)  # what parking B costs, once
        copies.append((time.perf_counter() - t0) * 1e3)
    runs = {w: [] for w in WAYS}
    for _ in range(ROUNDS):
        sizes = (SHORT, LONG, SHORT, 16)  # A, B, C and B's next question: both ways alike
        prompts = [rng.integers(16, 2000, n).tolist() for n in sizes]
        for way in WAYS:
            s = Scheduler(e, park=way == "parked")  # its own account: no hit across ways
            runs[way].append(asyncio.run(streams(s, prompts)))
    return {"step_ms": steps, "runs": runs, "copy_ms": min(copies)}


def summary(m: dict) -> dict:
    out = {}
    for way in WAYS:
        rs = m["runs"][way]
        out[way] = {
            "step_ms": min(m["step_ms"][way]),
            "after_tok_s": max(r["after_tok_s"] for r in rs),
            "after_tok_s_all": [r["after_tok_s"] for r in rs],
            "turn2_ttft_s": min(r["turn2_ttft_s"] for r in rs),
            "turn2_cached": [r["cached"] for r in rs],
        }
    return out


def markdown(r: dict) -> str:
    title = "A conversation held between running streams, bangla-0.4b int4 random weights"
    lines = [
        *report.heading(title, r),
        f"{report.cpu_line(r['cpu'])} {THREADS} threads, {SLOTS} slots. Streams A and C "
        f"({SHORT}-token prompts, {NEW} new ids) and B "
        f"(a {LONG}-token conversation, {LONG_NEW} new ids) arrive together in slots 0-2; B "
        "ends first. Step: slots 0-2 with slot 1 a placeholder row (mean of "
        f"{STEPS}, best of 3 in each of {ROUNDS} rounds); the scheduler's figures are the best "
        f"of {ROUNDS} rounds, the two ways taking turns in one process. Machine load: "
        f"{r['machine_load']}; foreign CPU {r['foreign_cpu_s']:.1f} s of {r['wall_s']:.0f} s.",
        "",
        "| B's cache | step of slots 0-2 ms | A + C ids/s after B ends (each round) | B's next "
        "turn, first id s | its ids from the cache |",
        "|---|---:|---|---:|---:|",
    ]
    for way, x in r["summary"].items():
        each = ", ".join(f"{v:.0f}" for v in x["after_tok_s_all"])
        lines.append(
            f"| {way} | {x['step_ms']:.2f} | **{x['after_tok_s']:.0f}** ({each}) | "
            f"{x['turn2_ttft_s']:.3f} | {', '.join(map(str, x['turn2_cached']))} |"
        )
    lines += [
        "",
        f"Parking B (copying its {LONG} positions to slot 3) took {r['copy_ms']:.1f} ms, once. "
        f"A's and C's ids the same both ways: {r['same_ids']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = report.parser(__doc__, work=report.SERVE_WORK_HELP).parse_args(argv)
    work = Path(args.work or report.SERVE_WORK)
    setup(work, FULL, with_llama=False)  # reuses the checkpoint and bundles already there
    t0 = time.perf_counter()
    m, foreign = foreign_cpu(measure, work / "bundle-int4")
    ids = {w: [r["ids"] for r in m["runs"][w]] for w in WAYS}
    result = report.stamp() | {
        "summary": summary(m),
        "same_ids": ids[WAYS[0]] == ids[WAYS[1]],
        "copy_ms": m["copy_ms"],
        "foreign_cpu_s": foreign,
        "wall_s": time.perf_counter() - t0,
        "machine_load": report.load_line(),
    }
    name = f"held_prefix_0.4b_cpu-{result['cpu']['class']}"
    report.publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
