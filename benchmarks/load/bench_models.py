"""Two models on one machine: one doel-serve serving both against two llama-server processes.

What a laptop user who keeps a base and a chat model, or an int4 and an int8 build, at hand gets
from each (issue 45): the 0.4B preset's random weights (benchmarks/load/load_model.py) as the int4
and int8 bundles in one `doel-serve A B` (the second loaded on its first request), and as the
q4_0 and q8_0 GGUF in two llama-server processes (each loads at its start; the vendored build's
router mode is not used). Both sides get 4 slots and 8,192 positions of KV cache per model and 2
threads. Measured: memory once ready, the first request to the second model (doel-serve loads
it then; llama-server had it loaded since its start, which the start time shows), then 4 clients
on each model at once (128-token Bangla prompts, 128 new tokens, greedy, streamed, 2 rounds):
aggregate tokens/s and the peak memory of everything each side runs (Pss, what the system pays,
with resident memory beside it: load_servers.Peak). The result:
benchmarks/results/serve_models_0.4b_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import cpu_name, heading, parser, publish, stamp
from benchmarks.load.load_client import run_level
from benchmarks.load.load_model import Prompts, prepare
from benchmarks.load.load_servers import BINARY, CACHE, THREADS, Peak, Server

RESULTS = ("serve_models_0.4b_cpu-<class>",)

SLOTS, POSITIONS, CLIENTS, NEW_TOKENS, PROMPT = 4, 8192, 4, 128, 128


def start(kind: str, made: dict, work: Path) -> tuple[list[Server], list[str], float]:
    """The servers of one side, ready; the model name each request names; seconds to ready."""
    t0 = time.perf_counter()
    if kind == "doel":
        flags = ("--slots", str(SLOTS), "--kv-positions", str(SLOTS * 2048), "--max-models", "2")
        # The second bundle through --models, a folder of hard links to it (argparse takes no
        # second BUNDLE after the flags server_command puts first).
        second = work / "second-model" / made["int8"].name
        if not second.is_dir():
            shutil.copytree(made["int8"], second, copy_function=os.link)
        flags += ("--models", str(second.parent))
        servers = [Server("doel", made["int4"], work / "doel.log", flags)]
        names = [made["int4"].name, made["int8"].name]
    else:
        flags = ("-np", str(SLOTS), "-c", str(POSITIONS))
        servers = [
            Server("llama", made[q], work / f"llama-{q}.log", flags) for q in ("q4_0", "q8_0")
        ]
        names = ["q4_0", "q8_0"]
    for s in servers:
        s.wait_ready()
    return servers, names, time.perf_counter() - t0


def measure(kind: str, made: dict, prompts: Prompts, work: Path) -> dict:
    servers, names, ready_s = start(kind, made, work)
    ports = [servers[0].port] * 2 if kind == "doel" else [s.port for s in servers]
    pids = [s.proc.pid for s in servers]
    body = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "stream_options": {"include_usage": True}}
    try:
        ready = Peak.now(pids)
        prompts.reset()
        second = body | {"model": names[1], "max_tokens": 16}
        cold = asyncio.run(run_level("127.0.0.1", ports[1], 1, [[prompts.take(PROMPT)]], second))
        texts = [[[prompts.take(PROMPT) for _ in range(2)] for _ in range(CLIENTS)] for _ in names]
        peak = Peak(pids)

        async def both():
            return await asyncio.gather(*(
                run_level("127.0.0.1", port, CLIENTS, t, body | {"model": name})
                for port, t, name in zip(ports, texts, names)
            ))  # fmt: skip

        t0 = time.perf_counter()
        got = asyncio.run(both())
        wall = time.perf_counter() - t0
        top = peak.stop()
    finally:
        for s in servers:
            s.close()
    return {
        "side": "doel-serve, both models" if kind == "doel" else "llama-server x 2",
        "ready_s": ready_s,
        "ready_pss_mb": ready["pss_mb"],
        "ready_rss_mb": ready["rss_mb"],
        "second_model_first_ms": cold["ttft_ms_p50"],
        "tok_s": sum(g["output_tokens"] for g in got) / wall,
        "tok_s_each": [g["aggregate_tok_s"] for g in got],
        "tbt_ms_p95": [g["tbt_ms_p95"] for g in got],
        "errors": sum(g["errors"] for g in got) + cold["errors"],
        "peak_pss_mb": top["pss_mb"],
        "peak_rss_mb": top["rss_mb"],
        "shmem_mappings": int(top["shmem_mappings"]),
    }


def _memory(r: dict, which: str) -> str:
    """Pss MB with RSS in brackets; RSS alone for results from before Pss was recorded."""
    rss = f"{r[f'{which}_rss_mb']:.0f}"
    pss = r.get(f"{which}_pss_mb")
    return rss if pss is None else f"{pss:.0f} ({rss})"


def markdown(result: dict) -> str:
    lines = heading("Two models, one machine: doel-serve against two llama-servers", result)
    what = " ".join(__doc__.split("\n", 2)[2].split("The result")[0].split())
    lines += [f"CPU: {cpu_name(result['cpu'])}. {what}"]
    lines += [
        "",
        "| side | ready s | Pss (RSS) ready MB | first request to the 2nd model ms | tok/s (both) "
        "| tok/s each | p95 gap ms each | peak Pss (RSS) MB | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        each = " / ".join(f"{v:.1f}" for v in r["tok_s_each"])
        gaps = " / ".join(f"{v:.0f}" for v in r["tbt_ms_p95"])
        lines.append(
            f"| {r['side']} | {r['ready_s']:.1f} | {_memory(r, 'ready')} | "
            f"{r['second_model_first_ms']:.0f} | {r['tok_s']:.1f} | {each} | {gaps} | "
            f"{_memory(r, 'peak')} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, work="model folder, kept and reused (default ~/.cache/doel/bench-load)")
    args = ap.parse_args(argv)
    if not BINARY.is_file():
        raise SystemExit(
            f"llama-server is not built ({BINARY}): run bench_load --install-llama-server"
        )
    work = Path(args.work or CACHE / "bench-load")
    made = prepare(work, [("int4", "q4_0"), ("int8", "q8_0")])
    prompts = Prompts(made["int4"])
    result = stamp(python=True) | {"argv": sys.argv[1:] if argv is None else argv}
    result["threads"] = THREADS
    result["rows"] = [measure(kind, made, prompts, work) for kind in ("doel", "llama")]
    publish(args.out, f"serve_models_0.4b_cpu-{this_cpu()['class']}", result, markdown(result))


if __name__ == "__main__":
    main()
