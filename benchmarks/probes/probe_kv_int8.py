"""The int8 KV cache against the fp32 one, engine-level: decode speed and held-out loss.

`doel-export --kv-cache int8` (export/kvcache.py) has ONNX Runtime's GroupQueryAttention write
and read an int8 cache, a quarter of the fp32 cache's bytes. One node timed alone
(probe_kv_cache) keeps its layer's cache in the CPU's caches; a decode step reads every layer's
from memory. So this probe times whole steps through the engine (serve/core/engine.py, 2
threads): for SmolLM2-135M-Instruct (imported weights) and the 0.4B preset (random weights),
int4 and int8 bundles exported twice from one checkpoint, differing only in the cache. In each
of PROCESSES processes both bundles' engines hold a slot of LONGEST real-text ids, then take
turns over ROUNDS rounds: STEPS one-id steps after each of CONTEXTS cached positions, and
STEPS steps of all ROWS slots at once after ROWS_AT; each cell is the best of every round and
process; and a prefill of each of PROMPTS ids in PREFILL_ROUNDS of the rounds (the time to the
first token, chunked as doel-serve chunks it). The loss: both engines on WINDOWS windows of 512
ids of the shared validation text per language (text the export's calibration did not read),
nats a token and top-1 agreement.

`flock /tmp/doel-bench.lock python -m benchmarks.probes.probe_kv_int8`: about 20 minutes (the
exports are cached in ~/.cache/doel/kv-int8); writes
benchmarks/results/kv_int8_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.report import ROOT, cpu_line, heading, load_line, parser, publish, stamp
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.load.load_model import _export, checkpoint, split_files
from benchmarks.load.load_servers import CACHE

RESULTS = ("kv_int8_cpu-<class>",)

CONTEXTS = (128, 1536, 4000)
LONGEST = 4100
ROWS = 8
ROWS_AT = 128  # cached positions of each row in the batched step
STEPS = 32
ROUNDS = 7
PROMPTS = (128, 1536)  # prefills timed in the first PREFILL_ROUNDS rounds
PREFILL_ROUNDS = 3
PROCESSES = 2
WINDOWS = 4
CACHES = ("fp32", "int8")
QUANTS = ("int4", "int8")


def checkpoints() -> dict[str, Path]:
    from benchmarks.export.bench_real_model import imported

    return {
        "smollm2-135m": imported(CACHE / "bench-load-smollm2-135m"),
        "0.4b": checkpoint(CACHE / "bench-load"),
    }


def bundle(ckpt: Path, model: str, quant: str, cache: str) -> Path:
    """The bundle, exported once into ~/.cache/doel/kv-int8 (SmolLM2 with the loss bound lifted,
    as the load benchmarks export it: int4 past it is llama.cpp's q4_0 too)."""
    out = CACHE / "kv-int8" / f"{model}-{quant}-{cache}"
    if not (out / "manifest.json").is_file():
        print(f"exporting {model} {quant}, {cache} cache ...", flush=True)
        lifted = ("--max-loss-increase", "1e6") if model == "smollm2-135m" else ()
        flags = ("--quant", quant, "--kv-cache", cache, "--eval-tokens", "256", *lifted)
        _export(ckpt, out, *flags)
    return out


def held_out(tokenizer: Path) -> list[list[int]]:
    """WINDOWS windows of 512 ids per language from the validation split's first file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    out = []
    for files in split_files("validation").values():
        ids = tok.encode(files[0].read_text(encoding="utf-8")[:200_000]).ids
        out += [ids[i * 512 : (i + 1) * 512] for i in range(WINDOWS)]
    return out


def _nll(logits, ids) -> tuple[float, list[int]]:
    """Summed nats of each next id (the export's own scoring) and each position's top pick."""
    import numpy as np

    from doel.export.runner import nll_sum

    return nll_sum(logits[:-1], np.array(ids[1:])), logits[:-1].argmax(1).tolist()


def child(paths: dict[str, str], with_loss: bool) -> dict:
    """One process: both caches' engines, interleaved (module docstring)."""
    from doel.serve.core.engine import Engine, read_bundle

    engines = {c: Engine(read_bundle(p), threads=2, slots=ROWS) for c, p in paths.items()}
    windows = held_out(Path(paths["fp32"]) / "tokenizer.json")
    room = min(e.context_length for e in engines.values())  # the 0.4B preset holds 2,048
    text = [i for w in windows for i in w][: min(LONGEST, room)]
    contexts = [c for c in CONTEXTS if c + STEPS <= len(text)]
    for e in engines.values():
        e.warm_up()
        e.forward(text, 0)
        for slot in range(1, ROWS):
            e.forward(text[:ROWS_AT], 0, slot=slot)
    best: dict = {}
    for r in range(ROUNDS):
        for cache in CACHES if r % 2 == 0 else CACHES[::-1]:
            e = engines[cache]
            for c in contexts:
                t0 = time.perf_counter()
                for i in range(STEPS):
                    e.decode([text[c + i]], [c + i + 1])
                ms = (time.perf_counter() - t0) / STEPS * 1e3
                best[f"{cache} {c}"] = min(best.get(f"{cache} {c}", 1e9), ms)
            t0 = time.perf_counter()
            for i in range(STEPS):
                e.decode([text[ROWS_AT + i]] * ROWS, [ROWS_AT + i + 1] * ROWS)
            ms = (time.perf_counter() - t0) / STEPS * 1e3
            best[f"{cache} rows"] = min(best.get(f"{cache} rows", 1e9), ms)
            for n in PROMPTS if r < PREFILL_ROUNDS else ():
                t0 = time.perf_counter()
                e.forward(text[:n], 0, slot=1)  # the same ids as the slot held: nothing moves
                ms = (time.perf_counter() - t0) * 1e3
                best[f"{cache} prefill {n}"] = min(best.get(f"{cache} prefill {n}", 1e9), ms)
    out = {"ms": best}
    if with_loss:
        sums = {c: 0.0 for c in CACHES}
        picks = {c: [] for c in CACHES}
        for w in windows:
            for c, e in engines.items():
                nll, top1 = _nll(e.forward(w, 0, every=True), w)
                sums[c] += nll
                picks[c] += top1
        n = sum(len(w) - 1 for w in windows)
        out["nats_per_token"] = {c: s / n for c, s in sums.items()}
        agree = sum(a == b for a, b in zip(picks["fp32"], picks["int8"])) / n
        out["top1_agreement"] = agree
        out["tokens"] = n
    return out


def measure(paths: dict[str, Path]) -> dict:
    """PROCESSES children; each cell the best over them."""
    runs = []
    for p in range(PROCESSES):
        arg = json.dumps({"paths": {c: str(v) for c, v in paths.items()}, "loss": p == 0})
        cmd = [sys.executable, "-m", "benchmarks.probes.probe_kv_int8", "--child", arg]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"the probe's process failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    got = runs[0] | {"ms": {k: min(r["ms"][k] for r in runs) for k in runs[0]["ms"]}}
    got["per_process_ms"] = [r["ms"] for r in runs]
    return got


def _pair(ms: dict, cell: str) -> str:
    """'fp32 / int8 (ratio)' for one cell, or – where the model's context is shorter."""
    a, b = ms.get(f"fp32 {cell}"), ms.get(f"int8 {cell}")
    return "–" if a is None or b is None else f"{a:.2f} / {b:.2f} ({b / a:.2f})"


def markdown(r: dict) -> str:
    head = " | ".join(f"after {c}: fp32 / int8 ms" for c in CONTEXTS)
    lines = [
        *heading("The int8 KV cache against fp32, engine-level", r),
        f"{cpu_line(r['cpu'])} 2 threads. Machine load: {r['machine_load']}; foreign CPU "
        f"{r['foreign_cpu_s']:.1f} s of {r['wall_s']:.0f} s.",
        "",
        f"Milliseconds a step, best of {ROUNDS} rounds of {STEPS} steps in each of {PROCESSES} "
        f"processes, the two caches taking turns; int8 / fp32 in brackets (below 1: the int8 "
        f"cache is faster). {ROWS} rows: one step of {ROWS} sequences after {ROWS_AT} positions "
        "each. "
        f"Prefill: a prompt of n ids into an empty slot, in {PREFILL_ROUNDS} of the rounds.",
        "",
        f"| model | bundle | {head} | {ROWS} rows: fp32 / int8 ms | "
        + " | ".join(f"prefill {n}: fp32 / int8 ms" for n in PROMPTS)
        + " |",
        "|---|---|" + "---:|" * (len(CONTEXTS) + 1 + len(PROMPTS)),
    ]
    for key, x in r["cells"].items():
        model, quant = key.split(" ")
        ms = x["ms"]
        cells = [_pair(ms, str(c)) for c in CONTEXTS] + [_pair(ms, "rows")]
        cells += [_pair(ms, f"prefill {n}") for n in PROMPTS]
        lines.append(f"| {model} | {quant} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Held-out loss ({WINDOWS} windows of 512 ids per language, the validation split)",
        "",
        "| model | bundle | fp32 cache nats/token | int8 cache nats/token | increase "
        "| top-1 agreement |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, x in r["cells"].items():
        model, quant = key.split(" ")
        n = x["nats_per_token"]
        lines.append(
            f"| {model} | {quant} | {n['fp32']:.4f} | {n['int8']:.4f} | "
            f"{n['int8'] - n['fp32']:+.4f} | {x['top1_agreement']:.3f} |"
        )
    lines += [
        "",
        "The 0.4B preset's weights are random: its loss says only that the int8 cache follows "
        "the fp32 one. SmolLM2's export calibrated the scales on the export's own held-out "
        "text, not on these windows.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        print(json.dumps(child(spec["paths"], spec["loss"])))
        return
    args = parser(__doc__).parse_args(argv)
    result = stamp() | {"cells": {}, "foreign_cpu_s": 0.0, "wall_s": 0.0}
    for model, ckpt in checkpoints().items():
        for quant in QUANTS:
            paths = {c: bundle(ckpt, model, quant, c) for c in CACHES}
            print(f"measuring {model} {quant} ...", flush=True)
            t0 = time.perf_counter()
            got, foreign = foreign_cpu(measure, paths)
            result["wall_s"] += time.perf_counter() - t0
            result["foreign_cpu_s"] += foreign
            manifest = json.loads((paths["int8"] / "manifest.json").read_text())
            got["export_loss"] = manifest["parity"]["loss"]["increase_nats_per_token"]
            result["cells"][f"{model} {quant}"] = got
    result["machine_load"] = load_line()
    publish(args.out, f"kv_int8_cpu-{result['cpu']['class']}", result, markdown(result))


if __name__ == "__main__":
    main()
