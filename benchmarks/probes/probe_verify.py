"""What verifying a draft costs: one run of several ids after a cache against a one-id step.

Prompt-lookup drafting (serve/core/step.py's `_speculate`) feeds a lone sequence's last id and
its draft in one run and keeps what the model picks; it pays where the run of n ids costs less
than the ids it is expected to keep. This probe times that run on SmolLM2-135M-Instruct's int4
and int8 bundles (benchmarks/load/load_model.py's, made once in ~/.cache/doel) through the
engine's own binding (serve/core/engine.py, 2 threads): a cache of CACHED positions, then runs of
IDS ids each writing at the same place, every position's logits out, the lengths interleaved,
best of ROUNDS. It also asks ONNX Runtime for such a run over two sequences at once and records
its answer (why only a lone sequence drafts).

`flock /tmp/doel-bench.lock python -m benchmarks.probes.probe_verify`: about a minute; writes
benchmarks/results/verify_smollm2-135m_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common.report import cpu_line, heading, load_line, parser, publish, stamp
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.load.load_model import prepare
from benchmarks.load.load_servers import CACHE

RESULTS = ("verify_smollm2-135m_cpu-<class>",)

CACHED = 256
IDS = (1, 2, 3, 4, 5, 6, 7, 9)  # a one-id step, then a last id and drafts of 1..8
ROUNDS = 15


def measure(bundle: Path) -> dict:
    from doel.serve.core.engine import Engine, read_bundle

    engine = Engine(read_bundle(bundle), threads=2, slots=2)
    engine.warm_up()
    for slot in (0, 1):
        engine.forward(list(range(100, 100 + CACHED)), 0, slot=slot)
    best = {n: float("inf") for n in IDS}
    for r in range(ROUNDS):
        for n in IDS[r % len(IDS) :] + IDS[: r % len(IDS)]:
            t0 = time.perf_counter()
            engine._run_shared([[5] * n], [CACHED + n], 0, every=True)
            best[n] = min(best[n], time.perf_counter() - t0)
    try:
        engine._run_shared([[5, 6], [5, 6]], [CACHED + 2] * 2, 0, every=True)
        two = "accepted"
    except Exception as e:  # ONNX Runtime's own message, in one line
        two = str(e).splitlines()[-1].split("Status Message: ")[-1].rstrip(".")
    ms = {n: best[n] * 1e3 for n in IDS}
    return {"ms": ms, "ratio": {n: ms[n] / ms[1] for n in IDS}, "two_sequences": two}


def markdown(r: dict) -> str:
    lines = [
        *heading("Verifying a draft: a run of n ids after a cache, SmolLM2-135M-Instruct", r),
        f"{cpu_line(r['cpu'])} 2 threads; {CACHED} cached positions, the lengths interleaved, "
        f"best of {ROUNDS}. Machine load: {r['machine_load']}; foreign CPU "
        f"{r['foreign_cpu_s']:.1f} s.",
        "",
        "| bundle | " + " | ".join(f"{n} id{'s' if n > 1 else ''}" for n in IDS) + " |",
        "|---|" + "---:|" * len(IDS),
    ]
    for q, x in r["bundles"].items():
        cells = [f"{x['ms'][str(n)]:.2f} ms ({x['ratio'][str(n)]:.2f}×)" for n in IDS]
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    two = {q: x["two_sequences"] for q, x in r["bundles"].items()}
    lines += [
        "",
        "A run of n ids is the last id and a draft of n - 1; beside each, its time over a one-id "
        "step's. The same run over two sequences at once: "
        + "; ".join(f"{q}: {t}" for q, t in two.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    made = prepare(CACHE / "bench-load-smollm2-135m", [("int4", "q4_0"), ("int8", "q8_0")],
                   "smollm2-135m")  # fmt: skip
    result = stamp() | {"bundles": {}, "foreign_cpu_s": 0.0}
    for q in ("int4", "int8"):
        got, foreign = foreign_cpu(measure, made[q])
        # JSON keys are strings: the report reads them as such
        got["ms"] = {str(k): v for k, v in got["ms"].items()}
        got["ratio"] = {str(k): v for k, v in got["ratio"].items()}
        result["bundles"][q] = got
        result["foreign_cpu_s"] += foreign
    result["machine_load"] = load_line()
    name = f"verify_smollm2-135m_cpu-{result['cpu']['class']}"
    publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
