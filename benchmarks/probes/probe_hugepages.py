"""The engine's weights on 2 MB pages against 4 KB ones, and llama.cpp on each, in one run.

serve/core/hugepages.py moves the weight buffers ONNX Runtime repacked onto transparent huge
pages when an Engine is built. This probe measures what that does: for SmolLM2-135M-Instruct
(imported weights) and the 0.4B preset (random weights), int4 and int8, with bench_serve's
greedy loops (bench_serve_engines: a prefill, then one step per id). The two doel rows share a
process, taking turns run by run: one engine built with `DOEL_SERVE_HUGEPAGES` 1, one with 0
(each moves only what building it mapped; which is built first alternates by round), because a
process's memory reads run faster or slower for its whole life and a row per process measured
that more than the pages (an earlier version of this probe did). For comparison, llama.cpp
(llama-cpp-python, flash attention off, its default) on the same weights' q4_0 / q8_0 GGUF, as
installed and with glibc asked for huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which
marks every heap mapping MADV_HUGEPAGE), a process each. PROCESSES rounds, each one doel process
and the two llama.cpp ones. Per row: time to first token and decode ids/s after PROMPTS
real-text ids, best of REPEATS runs a process; the memory building and running the engine added
to the process's Pss (what the system pays), and the process's AnonHugePages. Each cell is the
best over rounds; every process's figures are in the JSON.

`flock /tmp/doel-bench.lock python -m benchmarks.probes.probe_hugepages`: about 15 minutes with
the bundles and GGUFs cached (probe_kv_int8's and bench_load's folders in ~/.cache/doel);
writes benchmarks/results/hugepages_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.report import (
    ROOT,
    cpu_line,
    heading,
    load_line,
    parser,
    publish,
    render_again,
    stamp,
)
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.load.load_model import prepare
from benchmarks.load.load_servers import CACHE
from benchmarks.probes.probe_kv_int8 import bundle, checkpoints, held_out
from doel.contracts import memory
from doel.serve.core import hugepages
from doel.serve.core.hugepages import SWITCH

RESULTS = ("hugepages_cpu-<class>",)

PROMPTS = {"short": 128, "long": 1536}
REPEATS = {"short": 5, "long": 2}
NEW_TOKENS = 33
PROCESSES = 4
PAIRS = {"int4": "q4_0", "int8": "q8_0"}
# name: (engine, environment)
VARIANTS = {
    "doel, 2 MB pages (default)": ("doel", {SWITCH: "1"}),
    "doel, 4 KB pages": ("doel", {SWITCH: "0"}),
    "llama.cpp as installed": ("llama", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}),
    "llama.cpp, glibc huge pages": ("llama", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}),
}
DOEL = tuple(v for v, (engine, _) in VARIANTS.items() if engine == "doel")
LLAMA = tuple(v for v, (engine, _) in VARIANTS.items() if engine == "llama")
FOLDERS = {"smollm2-135m": "bench-load-smollm2-135m", "0.4b": "bench-load"}


def _memory() -> dict:
    """This process's Pss (doel.contracts.memory) and AnonHugePages, MB."""
    pss = memory.measure().pss_bytes
    return {"pss_mb": pss / 2**20, "anon_huge_mb": hugepages.huge_bytes() / 2**20}


def _spec(ids: list[int]) -> dict:
    prompts = {name: ids[:n] for name, n in PROMPTS.items()}
    return {"prompts": prompts, "new_tokens": NEW_TOKENS, "repeats": REPEATS}


def _best(runs: list[dict]) -> dict:
    """The fastest first token and the fastest decode of several runs."""
    ttft, tok_s = min(r["ttft_s"] for r in runs), max(r["decode_tok_s"] for r in runs)
    return {"ttft_s": ttft, "decode_tok_s": tok_s}


def doel_child(path: str, ids: list[int], first: str) -> dict:
    """One process, both doel rows: an engine built with the switch on and one with it off
    (`first` built first; each collapses only what building it mapped), taking turns."""
    from benchmarks.serve.bench_serve_engines import doel_runner

    order = [first] + [v for v in DOEL if v != first]
    runs, out = {}, {}
    for name in order:
        pss, t0 = _memory()["pss_mb"], time.perf_counter()
        os.environ.update(VARIANTS[name][1])
        runs[name] = doel_runner(path, 2)
        runs[name](ids[:8], 2)  # warm-up, as bench_serve_engines.measure
        out[name] = {"load_s": time.perf_counter() - t0, "pss_mb": _memory()["pss_mb"] - pss}
    spec = _spec(ids)
    for p, prompt in spec["prompts"].items():
        got = {name: [] for name in order}
        for _ in range(REPEATS[p]):
            for name in order:
                got[name].append(runs[name](prompt, NEW_TOKENS))
        for name in order:
            out[name][p] = _best(got[name])
    huge = _memory()["anon_huge_mb"]
    for name in order:  # the process's: only the switched-on engine's weights are on them
        out[name]["anon_huge_mb"] = huge if VARIANTS[name][1][SWITCH] == "1" else 0.0
    return out


def llama_child(path: str, ids: list[int]) -> dict:
    """One process: llama.cpp's prefill and decode on the prompts, as bench_serve times them."""
    from benchmarks.serve.bench_serve_engines import llama_runner, measure

    pss, t0 = _memory()["pss_mb"], time.perf_counter()
    run = llama_runner(path, 2, 2048, False)
    load_s = time.perf_counter() - t0
    got = measure(run, _spec(ids))
    out = {p: {k: got[p][k] for k in ("ttft_s", "decode_tok_s")} for p in PROMPTS}
    memory = _memory()
    return out | {"load_s": load_s, "pss_mb": memory["pss_mb"] - pss, **memory}


def _child(arg: dict, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.probes.probe_hugepages", "--child", json.dumps(arg)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ | env)
    if proc.returncode:
        raise SystemExit(f"the probe's process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_pair(paths: dict[str, Path], ids: list[int]) -> dict:
    """PROCESSES rounds: a doel process (both doel rows, the first built alternating by round)
    and one process of each llama.cpp row; each figure the best over rounds."""
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(PROCESSES):
        arg = {"engine": "doel", "path": str(paths["doel"]), "ids": ids, "first": DOEL[r % 2]}
        for name, row in _child(arg, {}).items():
            runs[name].append(row)
        for name in LLAMA:
            arg = {"engine": "llama", "path": str(paths["llama"]), "ids": ids}
            runs[name].append(_child(arg, VARIANTS[name][1]))
    best = {}
    for name, rs in runs.items():
        best[name] = {p: _best([x[p] for x in rs]) for p in PROMPTS}
        best[name] |= {k: min(x[k] for x in rs) for k in ("pss_mb", "load_s")}
        best[name]["anon_huge_mb"] = max(x["anon_huge_mb"] for x in rs)
    return {"best": best, "per_process": runs}


def _paired(per_process: dict, prompt: str) -> tuple[float, int, int]:
    """The median over processes of the 2 MB row's decode over the 4 KB row's, how many of
    those pairs the 2 MB row won, and how many there were."""
    on, off = ([x[prompt]["decode_tok_s"] for x in per_process[v]] for v in DOEL)
    ratios = sorted(a / b for a, b in zip(on, off))
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return median, sum(x > 1 for x in ratios), len(ratios)


def markdown(r: dict) -> str:
    on, off = list(VARIANTS)[:2]
    lines = [
        *heading("The engine's weights on 2 MB pages", r),
        f"{cpu_line(r['cpu'])} 2 threads. Machine load: {r['machine_load']}; foreign CPU "
        f"{r['foreign_cpu_s']:.1f} s of {r['wall_s']:.0f} s. Transparent huge pages: "
        f"`{r['thp']}`; kernel {r['kernel']}.",
        "",
        f"{NEW_TOKENS} new ids after {PROMPTS['short']} / {PROMPTS['long']} ids of real text, "
        f"greedy; best of {REPEATS['short']} / {REPEATS['long']} runs a process over "
        f"{PROCESSES} rounds. The two doel rows share a process and take turns run by run; "
        "llama.cpp's rows have a process each. Pss MB: what building and running the engine "
        "added to the process's Pss (what the system pays); on 2 MB pages: the process's "
        "AnonHugePages.",
        "",
        "| model | bundle / GGUF | row | decode ids/s after 128 / 1,536 | time to first token s "
        "| Pss MB | on 2 MB pages MB | load s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, cell in r["cells"].items():
        model, quant = key.split(" ")
        for name, x in cell["best"].items():
            s, g = x["short"], x["long"]
            what = quant if name.startswith("doel") else PAIRS[quant]
            lines.append(
                f"| {model} | {what} | {name} | {s['decode_tok_s']:.1f} / {g['decode_tok_s']:.1f} "
                f"| {s['ttft_s']:.3f} / {g['ttft_s']:.2f} | {x['pss_mb']:.0f} "
                f"| {x['anon_huge_mb']:.0f} | {x['load_s']:.2f} |"
            )
    lines += [
        "",
        "## Ratios",
        "",
        "| model | bundle | decode, 2 MB / 4 KB pages, after 128 / 1,536: best of each row "
        "| the same, median of each process's pair (pairs 2 MB won) | time to first token, "
        "4 KB / 2 MB | Pss, 2 MB / 4 KB | llama.cpp's own decode, glibc huge pages / as "
        "installed, after 128 / 1,536 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for key, cell in r["cells"].items():
        model, quant = key.split(" ")
        b = cell["best"]
        d = [b[on][p]["decode_tok_s"] / b[off][p]["decode_tok_s"] for p in PROMPTS]
        paired = [_paired(cell["per_process"], p) for p in PROMPTS]
        t = [b[off][p]["ttft_s"] / b[on][p]["ttft_s"] for p in PROMPTS]
        names = list(VARIANTS)[2:]
        ll = [b[names[1]][p]["decode_tok_s"] / b[names[0]][p]["decode_tok_s"] for p in PROMPTS]
        pairs = " / ".join(f"{m:.2f} ({won} of {n})" for m, won, n in paired)
        lines.append(
            f"| {model} | {quant} | {d[0]:.2f} / {d[1]:.2f} | {pairs} | {t[0]:.2f} / {t[1]:.2f} "
            f"| {b[on]['pss_mb'] / b[off]['pss_mb']:.2f} | {ll[0]:.2f} / {ll[1]:.2f} |"
        )
    lines += [
        "",
        "Above 1: the first-named row is faster (or, for memory, larger). A process's pair is "
        "its two doel rows, measured in turns in one process: their ratio leaves out how fast "
        "that process's memory happened to be. The targets against llama.cpp are bench_serve's "
        "(`serve_*` results), not these rows'.",
        "",
    ]
    return "\n".join(lines)


def _system() -> dict:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {
        "thp": thp.read_text().strip() if thp.exists() else "absent",
        "kernel": os.uname().release,
    }


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        if spec["engine"] == "doel":
            print(json.dumps(doel_child(spec["path"], spec["ids"], spec["first"])))
        else:
            print(json.dumps(llama_child(spec["path"], spec["ids"])))
        return
    ap = parser(__doc__)
    ap.add_argument("--render", help="a result JSON to write as Markdown again (no measuring)")
    args = ap.parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return
    result = stamp() | _system() | {"cells": {}, "foreign_cpu_s": 0.0, "wall_s": 0.0}
    for model, ckpt in checkpoints().items():
        for quant, peer in PAIRS.items():
            doel = bundle(ckpt, model, quant, "fp32")
            gguf = prepare(CACHE / FOLDERS[model], [(quant, peer)], model)[peer]
            windows = held_out(doel / "tokenizer.json")
            ids = [i for w in windows for i in w][: PROMPTS["long"]]
            print(f"measuring {model} {quant} / {peer} ...", flush=True)
            t0 = time.perf_counter()
            got, foreign = foreign_cpu(measure_pair, {"doel": doel, "llama": gguf}, ids)
            result["wall_s"] += time.perf_counter() - t0
            result["foreign_cpu_s"] += foreign
            result["cells"][f"{model} {quant}"] = got
    result["machine_load"] = load_line()
    publish(args.out, f"hugepages_cpu-{result['cpu']['class']}", result, markdown(result))


if __name__ == "__main__":
    main()
