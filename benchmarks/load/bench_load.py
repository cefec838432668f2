"""Serving under load: doel-serve against llama-server, and against onnxruntime-genai in-process.

doel-serve against llama.cpp's llama-server over HTTP, and doel's engine against
onnxruntime-genai's Engine in-process, with the same requests (issue 33).

One model (benchmarks/load/load_model.py: the 0.4B preset's random weights, a tokenizer covering its
whole vocabulary; or with `--model smollm2-135m` the imported SmolLM2-135M-Instruct, issue 57) as a
doel bundle and as GGUF of the same width (int4 / q4_0, int8 / q8_0).
Each client (benchmarks/load/load_client.py) streams greedy completions of 128 new tokens, a Bangla
prompt of its own each (128 or 1,024 tokens of the shared validation text), `--rounds` in turn;
1, 4, 8 and 16 clients at once; a chat mode where each of 8 clients sends 3 turns, each turn's
prompt the last one plus its answer plus 64 new tokens of text, so prefix caches matter. Both
servers: 16 slots of 2,048 positions, 2 threads, prefix caching on, warmed
(benchmarks/load/load_servers.py). Every level records aggregate output tokens/s and characters/s
(Bangla ones apart), time to first token, time between tokens and request latency (p50, p95),
errors, the server's peak memory (Pss, what the system pays, with RSS beside it) and the 1-minute
load before it.

Each server runs in `--processes` processes, interleaved with its peer (doel, llama, llama,
doel, ...); a level's figures are those of its process with the best aggregate tokens/s. A run
measures what its flags select and merges it into the CPU class's result
(benchmarks/results/serve_load_<model>_cpu-<class>.{json,md,png}), replacing the same levels of an
earlier run, so the sweep can be split into runs short enough to hold the benchmark lock
(`flock /tmp/doel-bench.lock python -m benchmarks.load.bench_load ...`).

`--install-llama-server` builds llama-server once (cached); `--install-ortgenai` makes the
virtualenv with the newest onnxruntime-genai (`--inproc` needs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import command, parser, publish, stamp
from benchmarks.load.bench_load_report import figure, markdown, targets
from benchmarks.load.load_client import run_level
from benchmarks.load.load_model import DEFAULT_PAIRS, MODELS, PAIRS, Prompts, prepare
from benchmarks.load.load_servers import (
    BINARY,
    CACHE,
    Server,
    install_llama_server,
    tree_mb,
)

RESULTS = ("serve_load_0.4b_cpu-<class>", "serve_load_smollm2-135m_cpu-<class>")

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"doel": "doel-serve", "llama": "llama-server"}
GENAI_VENV = CACHE / "ortgenai-venv"
NEW_TOKENS, CHAT_TURNS, CHAT_PIECE, CHAT_CLIENTS = 128, 3, 64, 8
KEY = ("pair", "server", "mode", "prompt_tokens", "clients")


def install_ortgenai(venv: Path = GENAI_VENV) -> Path:
    """A virtualenv with the newest onnxruntime-genai that installs here (and numpy)."""
    py = venv / "bin" / "python"
    if not py.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "onnxruntime-genai", "numpy"], check=True)
    return py


def plan(args) -> list[tuple[str, int, int]]:
    """(mode, prompt tokens, clients) of each level an HTTP process measures, in order."""
    levels = [("plain", n, c) for n in args.prompt_tokens for c in args.clients if args.plain]
    return levels + ([("chat", args.prompt_tokens[0], CHAT_CLIENTS)] if args.chat else [])


def level_prompts(prompts: Prompts, mode: str, n: int, clients: int, rounds: int):
    if mode == "chat":
        return [
            [prompts.take(n)] + ["\n" + prompts.take(CHAT_PIECE) for _ in range(CHAT_TURNS - 1)]
            for _ in range(clients)
        ]
    return [[prompts.take(n) for _ in range(rounds)] for _ in range(clients)]


IDLE_WAIT = 5.0  # seconds after a process's last level before its idle memory is read


def http_process(kind: str, model: Path, pair: str, prompts: Prompts, args, work: Path) -> list:
    """One server process through every level of the plan, then its memory once idle
    (`idle_pss_mb` and `idle_rss_mb` on each of its rows: what a burst leaves behind)."""
    extra = tuple(args.doel_args.split()) if kind == "doel" else ()
    server = Server(kind, model, work / f"{kind}.log", extra)
    name = " ".join([NAMES[kind], *extra])
    rows = []
    try:
        server.wait_ready()
        prompts.reset()
        body = {"max_tokens": NEW_TOKENS, "temperature": 0.0}
        body["stream_options"] = {"include_usage": True}
        warm = level_prompts(prompts, "plain", 32, max(args.clients), 1)
        asyncio.run(run_level("127.0.0.1", server.port, len(warm), warm, body | {"max_tokens": 8}))
        for mode, n, clients in plan(args):
            load = os.getloadavg()[0]
            texts = level_prompts(prompts, mode, n, clients, args.rounds)
            server.sample_memory()
            got = asyncio.run(
                run_level("127.0.0.1", server.port, clients, texts, body, chat=mode == "chat")
            )
            row = {"pair": pair, "server": name, "mode": mode, "prompt_tokens": n}
            rows.append(row | got | peak_of(server.stop_sampling()) | {"load_1min": load})
            print(_line(rows[-1]), flush=True)
        time.sleep(IDLE_WAIT)
        idle = tree_mb(server.proc.pid)
        rows = [r | {"idle_pss_mb": idle["pss_mb"], "idle_rss_mb": idle["rss_mb"]} for r in rows]
    finally:
        server.close()
    return rows


def peak_of(sampled: dict) -> dict:
    """A level's memory keys from Server.stop_sampling()'s peaks: Pss (what the system pays),
    RSS beside it (the key earlier results have), and any shared anonymous mappings seen,
    whose released pages neither figure counts."""
    return {
        "peak_pss_mb": sampled["pss_mb"],
        "peak_rss_mb": sampled["rss_mb"],
        "shmem_mappings": int(sampled["shmem_mappings"]),
    }


def _line(r: dict) -> str:
    return (
        f"{r['server']:>18} {r['pair']} {r['mode']:>6} {r['prompt_tokens']:>5} x{r['clients']:>2}: "
        f"{r['aggregate_tok_s']:6.1f} tok/s, TTFT p95 {r['ttft_ms_p95'] or 0:7.0f} ms, "
        f"errors {r['errors']}, load {r.get('load_1min', 0):.1f}"
    )


def inproc_process(
    kind: str, bundle: Path, pair: str, prompts: Prompts, args, work: Path, n: int | None = None
):
    """One process of doel's engine or onnxruntime-genai's through the in-process levels, or
    (`ceiling`) of doel's engine timing its prefill and steps alone at the HTTP levels."""
    prompts.reset()
    n = n or args.prompt_tokens[0]
    levels = args.clients if kind == "ceiling" else args.inproc_clients
    spec = {"threads": 2, "slots": 16, "new_tokens": NEW_TOKENS, "rounds": args.rounds}
    spec |= {"levels": levels, "prompts": []}
    need = max(levels) if kind == "ceiling" else 2 + sum(levels) * args.rounds
    spec["prompts"] = [prompts.ids_of(n) for _ in range(need)]
    (work / "inproc.json").write_text(json.dumps(spec))
    py = str(args.ortgenai_python) if kind == "genai" else sys.executable
    cmd = [py] + command(
        "load.bench_load_inproc", kind, bundle, work / "inproc.json", work / "o.json"
    )[1:]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} in-process run failed:\n{proc.stderr[-3000:]}")
    got = json.loads((work / "o.json").read_text())
    server = {"doel": "doel engine", "ceiling": "doel engine, kernels alone"}.get(
        kind, f"onnxruntime-genai {got.get('version', '')}".strip()
    )
    mode = "ceiling" if kind == "ceiling" else "inproc"
    rows = []
    for pt in got["points"]:
        row = {"pair": pair, "server": server, "mode": mode, "prompt_tokens": n}
        rows.append(row | {"load_1min": load} | pt | {"peak_rss_mb": got["peak_rss_mb"]})
        if mode == "inproc":
            print(_line(rows[-1]), flush=True)
    return rows


def measure(args, work: Path, save) -> None:
    """Every process of the run, interleaved; `save(rows)` after each (a run stopped midway
    keeps what it measured)."""
    rows: list[dict] = []
    for pair in args.pair:
        made = prepare(work, [(pair, PAIRS[pair])], args.model)
        prompts = Prompts(made[pair])
        http = [("doel", made[pair]), ("llama", made[PAIRS[pair]])] if args.http else []
        http = [(kind, model) for kind, model in http if kind in args.servers]
        for p in range(args.processes):  # interleaved: doel, llama, then llama, doel, ...
            for kind, model in http[:: 1 if p % 2 == 0 else -1]:
                got = http_process(kind, model, pair, prompts, args, work)
                rows += [r | {"process": p} for r in got]
                save(rows)
            if args.inproc:
                for kind in ("doel", "genai")[:: 1 if p % 2 == 0 else -1]:
                    got = inproc_process(kind, made[pair], pair, prompts, args, work)
                    rows += [r | {"process": p} for r in got]
                    save(rows)
            if args.ceiling and "doel" in args.servers and args.http and args.plain:
                for n in args.prompt_tokens:
                    got = inproc_process("ceiling", made[pair], pair, prompts, args, work, n)
                    rows += [r | {"process": p} for r in got]
                    save(rows)


def best(rows: list[dict]) -> list[dict]:
    """Each level's row from its process with the best aggregate tokens/s."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(r[f] for f in KEY)
        if k not in out or r["aggregate_tok_s"] > out[k]["aggregate_tok_s"]:
            out[k] = r
    return list(out.values())


def merged(earlier: dict | None, rows: list[dict], run: dict) -> dict:
    """An earlier result (or none) with this run's rows replacing the same levels."""
    old = earlier or {"runs": [], "measurements": []}
    keys = {tuple(r[f] for f in KEY) for r in rows}
    kept = [r for r in old["measurements"] if tuple(r[f] for f in KEY) not in keys]
    return {"runs": old["runs"] + [run], "measurements": kept + rows}


def build_parser():
    ap = parser(
        __doc__,
        work="model folder, kept and reused (default ~/.cache/doel/bench-load, -MODEL beside it)",
    )
    ap.add_argument(
        "--model",
        choices=MODELS,
        default="0.4b",
        help="the 0.4B preset's random weights (default) or the imported SmolLM2-135M-Instruct",
    )
    ap.add_argument(
        "--pair",
        nargs="+",
        choices=list(PAIRS),
        default=DEFAULT_PAIRS,
        help="doel bundles to measure, each against its llama.cpp peer (default int4 int8; "
        "variants: int4-kv16, int4 with an fp16 KV cache; int8-b128, int8 in blocks of 128)",
    )
    ap.add_argument(
        "--clients",
        nargs="+",
        type=int,
        default=[1, 4, 8, 16],
        help="client levels over HTTP (default 1 4 8 16)",
    )
    ap.add_argument(
        "--prompt-tokens",
        nargs="+",
        type=int,
        default=[128, 1024],
        help="prompt lengths (default 128 1024; the first is the chat's and in-process)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn")
    ap.add_argument("--processes", type=int, default=3, help="processes per server (best of)")
    ap.add_argument(
        "--servers",
        nargs="+",
        choices=list(NAMES),
        default=list(NAMES),
        help="HTTP servers to run (default both: doel llama)",
    )
    ap.add_argument(
        "--no-plain",
        dest="plain",
        action="store_false",
        help="skip the levels of one prompt a request (with --chat: the chat alone)",
    )
    ap.add_argument("--no-http", dest="http", action="store_false", help="skip the HTTP levels")
    ap.add_argument(
        "--doel-args",
        default="",
        help="more doel-serve flags, e.g. '--step-tokens 32' (its rows are named with them, "
        "beside the default's)",
    )
    ap.add_argument("--chat", action="store_true", help="also the chat mode (8 clients, 3 turns)")
    ap.add_argument(
        "--inproc",
        action="store_true",
        help="also doel's engine against onnxruntime-genai's, in-process",
    )
    ap.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="skip timing doel's engine alone (its prefill and steps: the most any scheduling "
        "could serve at each HTTP level)",
    )
    ap.add_argument(
        "--inproc-clients",
        nargs="+",
        type=int,
        default=[8],
        help="in-process client levels (default 8)",
    )
    ap.add_argument(
        "--ortgenai-python",
        type=Path,
        default=GENAI_VENV / "bin" / "python",
        help="the interpreter with onnxruntime-genai (default: --install-ortgenai's)",
    )
    ap.add_argument(
        "--install-llama-server",
        action="store_true",
        help="build llama-server from the cached llama.cpp sources (once, ~10 min)",
    )
    ap.add_argument(
        "--install-ortgenai",
        action="store_true",
        help="make the onnxruntime-genai virtualenv (once)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.install_llama_server:
        install_llama_server()
    if args.install_ortgenai:
        args.ortgenai_python = install_ortgenai()
    if args.http and "llama" in args.servers and not BINARY.is_file():
        raise SystemExit(f"llama-server is not built ({BINARY}): run with --install-llama-server")
    if args.inproc and not args.ortgenai_python.is_file():
        raise SystemExit(f"{args.ortgenai_python} is missing: run with --install-ortgenai")
    default = CACHE / ("bench-load" if args.model == "0.4b" else f"bench-load-{args.model}")
    work = Path(args.work or default)
    run = stamp(python=True) | {"argv": sys.argv[1:] if argv is None else argv}
    run["load_start"], t0 = os.getloadavg()[0], time.perf_counter()
    name = f"serve_load_{args.model}_cpu-{this_cpu()['class']}"
    path = Path(args.out) / f"{name}.json"
    earlier = json.loads(path.read_text()) if path.is_file() else None

    def save(rows: list[dict]) -> None:
        """This run's rows so far merged into the result as it was when the run began."""
        done = run | {"load_end": os.getloadavg()[0], "wall_s": time.perf_counter() - t0}
        result = stamp(python=True) | merged(earlier, rows, done) | {"model": args.model}
        result["best"] = best(result["measurements"])
        result["targets"] = targets(result["best"])
        publish(args.out, name, result, markdown(result), figure(result))

    measure(args, work, save)


if __name__ == "__main__":
    main()
