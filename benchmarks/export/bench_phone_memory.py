"""The memory a phone needs for a bundle, its KV cache in fp32 against fp16.

Peak resident memory of a process that loads model.ort (what ONNX Runtime Mobile loads) and
fills a context of 512 or 2,048 positions, with the KV cache in fp32 and in fp16
(`doel-export --kv-cache fp16`, export/kvcache.py).

Each case runs in its own process, through serve/'s engine as an app would drive ONNX Runtime:
the cache preallocated for the context and bound as both past and present, the prompt fed in
chunks of serve's PREFILL_CHUNK, then DECODE single steps up to the context's last position.
Reported: the process before the session (Python, numpy, onnxruntime), after loading the model,
and its peak (VmHWM), beside the cache's own size; and the Pss after loading and at the end, what
the system pays (doel.contracts.memory: resident memory alone missed the cache's released pages
while it was shared anonymous memory, before issue 53). The peaks are resident memory's only:
the kernel keeps no high-water mark of Pss. Measured on x86 (no phone here): ARM's kernels
prepack weights differently, so a phone's figure can differ by their packed copies; its speed
with an fp16 cache is not measured at all (emulation says nothing of speed).

Run: `python -m benchmarks.export.bench_phone_memory KV_FP32_BUNDLE KV_FP16_BUNDLE --name 0.4b`
(bundles exported with --mobile). Writes benchmarks/results/phone_memory_NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import numpy as np

from doel.contracts import memory
from doel.serve.core.engine import Engine, read_bundle

RESULTS = ("phone_memory_<name>",)

ROOT = Path(__file__).resolve().parents[2]

CONTEXTS = (512, 2048)
DECODE = 32
THREADS = 2
REPEATS = 3  # the same load's resident memory varies by ~50 MB run to run (allocator arenas)
FIELDS = ("loaded_mb", "load_peak_mb", "run_peak_mb", "end_mb", "loaded_pss_mb", "end_pss_mb")
MODELS = ("model.ort", "model.onnx")  # ORT Mobile loads either; the ORT format is its own


def status_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def one(folder: Path, context: int, model: str) -> dict:
    """Load `model` of the bundle at `folder` for `context` positions and fill them."""
    before = status_mb("VmRSS")
    bundle = read_bundle(folder)
    if context > bundle.context_length:
        raise SystemExit(f"{folder} holds {bundle.context_length} positions, not {context}")
    t0 = time.perf_counter()
    engine = Engine(replace(bundle, model=folder / model, context_length=context), THREADS)
    loaded, load_peak = status_mb("VmRSS"), status_mb("VmHWM")
    loaded_pss = memory.measure().pss_mb
    # Loading peaks above what the session keeps (weights read, then packed for the kernels):
    # the peak is reset here (Linux: 5 to clear_refs) so that the run's own is seen apart.
    Path("/proc/self/clear_refs").write_text("5")
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, bundle.vocab_size, context - DECODE).tolist()
    logits = engine.forward(prompt, 0)
    for n in range(len(prompt), context):
        logits = engine.forward([int(np.argmax(logits))], n)
    return {
        "bundle": folder.name,
        "model": model,
        "model_mb": sum(f.stat().st_size for f in folder.glob(model + "*")) / 2**20,  # + .data
        "kv_dtype": np.dtype(engine.kv_dtype).name,
        "context": context,
        "kv_cache_mb": sum(a.nbytes for a in engine.kv_arrays) / 2**20,
        "process_mb": before,
        "loaded_mb": loaded,
        "load_peak_mb": load_peak,
        "run_peak_mb": status_mb("VmHWM"),
        "end_mb": status_mb("VmRSS"),
        "loaded_pss_mb": loaded_pss,
        "end_pss_mb": memory.measure().pss_mb,
        "seconds": time.perf_counter() - t0,
    }


def repeated(folder: Path, context: int, model: str) -> dict:
    """`one` in REPEATS fresh processes: the median of each figure, and every run."""
    runs = []
    for _ in range(REPEATS):
        cmd = [sys.executable, "-m", "benchmarks.export.bench_phone_memory", "--one", str(folder)]
        cmd += [str(context), "--models", model]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{folder} at {context}: {proc.stderr.strip()[-600:]}")
        runs.append(json.loads(proc.stdout))
    row = dict(runs[0])
    row |= {k: float(np.median([r[k] for r in runs])) for k in FIELDS}
    row["runs"] = runs
    return row


def _mb(r: dict, key: str) -> str:
    """The median and, where the runs spread by 5 MiB or more, their range; "–" for a figure
    not measured (Pss, before it was)."""
    if r.get(key) is None:
        return "–"
    values = [run[key] for run in r["runs"]]
    spread = max(values) - min(values)
    return f"{r[key]:.0f}" + (f" ({min(values):.0f}-{max(values):.0f})" if spread >= 5 else "")


def markdown(report: dict) -> str:
    lines = [
        f"# Phone memory budget: {report['name']} ({report['date']})",
        "",
        "Resident memory of one process that loads a bundle's model.ort or model.onnx with "
        f"serve/'s engine ({THREADS} threads, prompt in chunks of {report['chunk']}, then "
        f"{DECODE} decode steps to the context's end): its peak while loading, after loading, "
        "and its peak while running (VmHWM, reset after the load). Process before the session: "
        f"Python + numpy + onnxruntime {report['onnxruntime']}. Median of {REPEATS} fresh "
        "processes (range where they spread by 5 MiB or more). Measured on x86 "
        f"({report['cpu']}), not on a phone; the speed of an fp16 cache on ARM is not measured.",
        "",
        "| file | bundle | KV cache | context | cache MiB | model files MiB | process MiB "
        "| load peak MiB | after load MiB | run peak MiB | run peak - process MiB "
        "| Pss after load MiB | Pss at the end MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['bundle']} | {r['kv_dtype']} | {r['context']:,} "
            f"| {r['kv_cache_mb']:.0f} | {r['model_mb']:.0f} | {r['process_mb']:.0f} "
            f"| {_mb(r, 'load_peak_mb')} | {_mb(r, 'loaded_mb')} | {_mb(r, 'run_peak_mb')} "
            f"| {r['run_peak_mb'] - r['process_mb']:.0f} | {_mb(r, 'loaded_pss_mb')} "
            f"| {_mb(r, 'end_pss_mb')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    # Not report.parser: the --one child measures its own resident memory from its start, so
    # it loads nothing of ours but the engine; the report's modules are imported below.
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="*", type=Path, help="--mobile bundles (fp32, fp16 cache)")
    p.add_argument("--name", default="0.4b")
    p.add_argument("--models", nargs="+", default=MODELS, help="the bundle files loaded")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")  # report.RESULTS
    p.add_argument("--one", nargs=2, metavar=("BUNDLE", "CONTEXT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(Path(args.one[0]), int(args.one[1]), args.models[0])))
        return
    import onnxruntime

    from benchmarks.common.cpu_class import this_cpu
    from benchmarks.common.report import publish
    from doel.serve.core.engine import PREFILL_CHUNK

    rows = []
    for model in args.models:
        for folder in args.bundles:
            for context in CONTEXTS:
                rows.append(repeated(folder, context, model))
                print(rows[-1], file=sys.stderr)
    cpu = this_cpu()
    report = {
        "name": args.name,
        "date": date.today().isoformat(),
        "chunk": PREFILL_CHUNK,
        "onnxruntime": onnxruntime.__version__,
        "cpu": f"{cpu['model_name']}, class {cpu['class']}",
        "rows": rows,
    }
    publish(args.out, f"phone_memory_{args.name}", report, markdown(report))


if __name__ == "__main__":
    main()
