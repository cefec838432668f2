"""Serving core before and after issue 53: doel-serve before its fixes against the working tree.

Chats running at once, tokens/s and time between tokens (p50, p95, p99) of doel-serve at
`--before` (61dc752, the code before the fixes) and of the working tree, in one run on one
machine.

Issue 53 asks for both before and after: concurrency and tokens/s of 16 clients sending chats
without max_tokens under --kv-positions 8192 (61dc752 reserves a request's whole context for it,
2,048 positions here: four at once), and p95/p99 time between tokens at 8 and 16 clients on the
load benchmark. One bundle (benchmarks/load/load_model.py: the 0.4B preset's random weights; its
tokenizer has doel's chat template), bench_load's server settings (load_servers.py: 16 slots,
2 threads), and in each process of each code two levels, each on a server of its own:

- chat: --kv-positions 8192; 16 clients, each `--chat-rounds` chats in turn to
  /v1/chat/completions (128 tokens of Bangla text as the user message; streamed, temperature 0,
  no max_tokens). Random weights would write to the context's end: the client reads `--cut`
  tokens and closes the stream (both codes then free the slot), `--wall` s at most a request.
  Recorded: requests running and waiting (the doel_requests_running and doel_queue_depth
  gauges of /metrics every 0.2 s: the most, and the mean running while any ran), replies
  streaming at once as the clients saw them, 400s and 429s, tokens read a second, TTFT.
- plain: bench_load's pool (16 x 2,048 positions), streamed completions of 128 new tokens on
  128-token prompts, 8 and 16 clients, `--rounds` each: time between tokens, TTFT, tokens/s.

"Before" runs from a git worktree of the revision (/tmp/doel-before-<sha>), imported ahead of
the editable checkout (PYTHONPATH=<worktree>, PYTHONSAFEPATH=1: the working folder is not put
first on sys.path); the doel.serve each code imports is checked and recorded. `--processes`
processes a code, interleaved (before, after; after, before); a level's figures are its best
process's by tokens/s; the 1-minute load is recorded before each level. Result:
benchmarks/results/serve_core_0.4b_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import cpu_line, heading, parser, publish, stamp
from benchmarks.load.load_client import CHAT_PATH, Outcome, run_level
from benchmarks.load.load_model import PAIRS, Prompts, prepare
from benchmarks.load.load_servers import CACHE, Server

RESULTS = ("serve_core_0.4b_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]
PROMPT, NEW_TOKENS, CHAT_CLIENTS, HOST = 128, 128, 16, "127.0.0.1"
KEY = ("code", "level", "clients")


def git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def before_tree(rev: str) -> Path:
    """A worktree of `rev` in /tmp (made once, kept)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = Path(f"/tmp/doel-before-{sha[:12]}")
    if not (tree / "serve").is_dir():
        git("worktree", "add", "--detach", str(tree), sha)
    if git("rev-parse", "HEAD", cwd=tree) != sha:
        raise SystemExit(f"{tree} is not at {sha}: remove it (git worktree remove {tree})")
    return tree


@contextlib.contextmanager
def code_of(tree: Path):
    """Processes started inside import doel from `tree`, not from the editable checkout."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    os.environ.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    try:
        yield
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
        for k in (k for k, v in saved.items() if v is None):
            os.environ.pop(k)


def served_from(tree: Path) -> str:
    """The doel.serve a server started from `tree` imports (refused if it is another's)."""
    with code_of(tree):
        cmd = [sys.executable, "-c", "import doel.serve as s; print(s.__file__)"]
        where = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    path = where.stdout.strip()
    if not Path(path).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"a server from {tree} would import {path}")
    return path


class Gauges:
    """doel_requests_running and doel_queue_depth from /metrics every 0.2 s until stop()."""

    NAMES = {"doel_requests_running": "running", "doel_queue_depth": "waiting"}

    def __init__(self, port: int):
        self.url, self.samples = f"http://127.0.0.1:{port}/metrics", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    text = r.read().decode()
                pairs = (line.partition(" ") for line in text.splitlines())
                got = {self.NAMES[k]: int(float(v)) for k, _, v in pairs if k in self.NAMES}
                self.samples.append(got)
            except OSError:
                pass
            if self._stop.wait(0.2):
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        run = [s.get("running", 0) for s in self.samples]
        busy = [r for r in run if r > 0]
        return {
            "running_max": max(run, default=None),
            "running_mean": sum(busy) / len(busy) if busy else None,
            "waiting_max": max((s.get("waiting", 0) for s in self.samples), default=None),
            "metrics_samples": len(self.samples),
        }


def streaming_at_once(outcomes: list[Outcome]) -> int:
    """The most replies between their first token and their end at one time (the clients')."""
    edges = []
    for o in outcomes:
        if o.ttft is not None:
            edges += [(o.start + o.ttft, 1), (o.start + max(o.end, o.ttft), -1)]
    most = now = 0
    for _, step in sorted(edges):
        now += step
        most = max(most, now)
    return most


def statuses(outcomes: list[Outcome]) -> dict:
    errors = [o.error for o in outcomes if o.error]
    return {
        "http_400": sum(e.startswith("HTTP 400") for e in errors),
        "http_429": sum(e.startswith("HTTP 429") for e in errors),
        "cut": sum(o.bounded == "cut" for o in outcomes),
        "wall_bounded": sum(o.bounded == "wall" for o in outcomes),
    }


def one_process(code: str, tree: Path, bundle: Path, prompts: Prompts, args, work: Path) -> list:
    """One server process of `tree` for the chat level, then one for the plain levels."""
    rows, body = [], {"temperature": 0.0, "stream_options": {"include_usage": True}}
    warm = [[prompts.take(32)] for _ in range(CHAT_CLIENTS)]
    for level, extra in (("chat", ("--kv-positions", str(args.kv_positions))), ("plain", ())):
        with code_of(tree):
            server = Server("doel", bundle, work / f"core-{code}.log", extra)
        try:
            server.wait_ready()
            warming = run_level(HOST, server.port, len(warm), warm, body | {"max_tokens": 8})
            asyncio.run(warming)
            for clients in [CHAT_CLIENTS] if level == "chat" else args.clients:
                rounds = args.chat_rounds if level == "chat" else args.rounds
                texts = [[prompts.take(PROMPT) for _ in range(rounds)] for _ in range(clients)]
                row = {"code": code, "level": level, "load_1min": os.getloadavg()[0]}
                bounds = {"path": CHAT_PATH, "cut": args.cut, "wall": args.wall}
                ask = bounds if level == "chat" else {}
                more = {} if level == "chat" else {"max_tokens": NEW_TOKENS}
                outcomes: list[Outcome] = []
                gauges = Gauges(server.port)
                level_run = run_level(HOST, server.port, clients, texts, body | more,
                                      outcomes=outcomes, **ask)  # fmt: skip
                got = asyncio.run(level_run) | gauges.stop()
                got["streaming_max"] = streaming_at_once(outcomes)
                rows.append(row | got | statuses(outcomes))
                print(line(rows[-1]), flush=True)
        finally:
            server.close()
    return rows


def line(r: dict) -> str:
    return (
        f"{r['code']:>6} {r['level']:>5} x{r['clients']:>2}: {r['aggregate_tok_s']:6.1f} tok/s, "
        f"TBT {_ms(r, 'tbt')} ms, running max {r['running_max']}, errors {r['errors']} "
        f"(400: {r['http_400']}, 429: {r['http_429']}), load {r['load_1min']:.1f}"
    )


def best(rows: list[dict]) -> list[dict]:
    """Each level's row from its process with the best tokens/s."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(r[f] for f in KEY)
        if k not in out or r["aggregate_tok_s"] > out[k]["aggregate_tok_s"]:
            out[k] = r
    return sorted(out.values(), key=lambda r: (r["level"], r["clients"], r["code"] != "before"))


def _ms(r: dict, what: str) -> str:
    """`what`'s p50 / p95 / p99 in ms (ttft, tbt)."""
    values = (r[f"{what}_ms_p{q}"] for q in (50, 95, 99))
    return " / ".join("-" if v is None else f"{v:.0f}" for v in values)


def _ratio(rows: list[dict], level: str, clients: int, field: str) -> str:
    got = {r["code"]: r.get(field) for r in rows if (r["level"], r["clients"]) == (level, clients)}
    b, a = got.get("before"), got.get("after")
    return f"{a / b:.2f}" if a is not None and b else "-"


def table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table (its first column left, the others right) and a blank line."""
    lines = ["| " + " | ".join(map(str, r)) + " |" for r in [head, *rows]]
    return [lines[0], "|---|" + "---:|" * (len(head) - 1), *lines[1:], ""]


def markdown(result: dict) -> str:
    rows, run = result["best"], result["run"]
    chat = [r for r in rows if r["level"] == "chat"]
    plain = [r for r in rows if r["level"] == "plain"]
    pct = "p50 / p95 / p99 ms"
    out = heading("Serving core before and after issue 53", result) + [
        cpu_line(result["cpu"]),
        f"Model: {run['model']}. Before: {run['before']['rev']} ({run['before']['serve']}); "
        f"after: the working tree at {run['after']['rev']} ({run['after']['serve']}). "
        f"Best of {run['processes']} processes each, interleaved; "
        f"`python -m benchmarks.load.bench_core {' '.join(run['argv'])}`.",
        "",
        f"## Chats without max_tokens: {CHAT_CLIENTS} clients, --kv-positions "
        f"{run['kv_positions']}",
        "",
        f"Each client sends {run['chat_rounds']} chats in turn (/v1/chat/completions, streamed, "
        f"temperature 0, no max_tokens) and closes each reply's stream after {run['cut']} tokens "
        f"(random weights would run to the context's end), {run['wall']:g} s at most a request.",
        "",
    ]
    out += table(
        ["code", "running at once, most / mean (/metrics)", "streaming at once (clients)",
         "waiting, most", "tok/s", f"TTFT {pct}", f"TBT {pct}", "400s", "429s", "other errors",
         "requests", "load before"],
        [[r["code"], f"{r['running_max']} / {r['running_mean'] or 0:.1f}", r["streaming_max"],
          r["waiting_max"], f"{r['aggregate_tok_s']:.1f}", _ms(r, "ttft"), _ms(r, "tbt"),
          r["http_400"], r["http_429"], r["errors"] - r["http_400"] - r["http_429"],
          r["requests"], f"{r['load_1min']:.1f}"] for r in chat],
    )  # fmt: skip
    out += [
        f"## Streamed completions, the load benchmark's pool: {PROMPT}-token prompts, "
        f"{NEW_TOKENS} new tokens, {run['rounds']} a client",
        "",
    ]
    out += table(
        ["code", "clients", "tok/s", f"TTFT {pct}", f"TBT {pct}", "errors", "load before"],
        [[r["code"], r["clients"], f"{r['aggregate_tok_s']:.1f}", _ms(r, "ttft"), _ms(r, "tbt"),
          r["errors"], f"{r['load_1min']:.1f}"] for r in plain],
    )  # fmt: skip
    most = {"aggregate_tok_s": "tok/s", "running_max": "most running at once"}
    ratios = [[f"chats: {n}", _ratio(rows, "chat", CHAT_CLIENTS, f)] for f, n in most.items()]
    figures = {"aggregate_tok_s": "tok/s", "tbt_ms_p95": "p95 time between tokens"}
    figures["tbt_ms_p99"] = "p99 time between tokens"
    for c in sorted({r["clients"] for r in plain}):
        ratios += [[f"{c} clients: {n}", _ratio(rows, "plain", c, f)] for f, n in figures.items()]
    return "\n".join(out + ["## After / before", ""] + table(["figure", "after / before"], ratios))


def build_parser():
    ap = parser(__doc__, work="model folder and servers' logs (default: bench_load's)")
    ap.add_argument("--before", default="61dc752", help="the revision before (default 61dc752)")
    ap.add_argument("--processes", type=int, default=2, help="processes a code (best of)")
    ap.add_argument("--pair", choices=list(PAIRS), default="int4", help="bundle (default int4)")
    ap.add_argument("--bundle", type=Path, help="another bundle (a smoke run; not the result)")
    ap.add_argument("--kv-positions", type=int, default=8192, help="the chat level's pool")
    ap.add_argument("--chat-rounds", type=int, default=2, help="chats a client sends in turn")
    ap.add_argument("--cut", type=int, default=256, help="tokens of a chat reply read")
    ap.add_argument("--wall", type=float, default=300.0, help="seconds a request at most")
    ap.add_argument("--clients", nargs="+", type=int, default=[8, 16], help="plain levels")
    ap.add_argument("--rounds", type=int, default=2, help="completions a client sends in turn")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    work = Path(args.work or CACHE / "bench-load")
    bundle = args.bundle or prepare(work, [(args.pair, PAIRS[args.pair])])[args.pair]
    config = json.loads((bundle / "tokenizer_config.json").read_text(encoding="utf-8"))
    if not config.get("chat_template"):
        raise SystemExit(f"{bundle} has no chat template: the chat level needs one")
    trees = {"before": before_tree(args.before), "after": ROOT}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    model = f"the 0.4B preset's random weights, {args.pair} (benchmarks/load/load_model.py)"
    run = {"argv": sys.argv[1:] if argv is None else argv, "bundle": str(bundle)}
    run["model"] = f"the bundle {bundle} (a smoke run)" if args.bundle else model
    run |= {k: getattr(args, k) for k in ("processes", "kv_positions", "chat_rounds", "cut")}
    run |= {"wall": args.wall, "rounds": args.rounds, "pair": args.pair}
    for code, tree in trees.items():
        rev = git("rev-parse", "--short=12", "HEAD", cwd=tree)
        rev += " with changes" if code == "after" and dirty else ""
        run[code] = {"rev": rev, "serve": served_from(tree)}
        print(f"{code}: {run[code]}", flush=True)
    name = "serve_core_" + (bundle.name if args.bundle else "0.4b") + f"_cpu-{this_cpu()['class']}"
    prompts, rows, t0 = Prompts(bundle), [], time.perf_counter()
    result = stamp(python=True)
    for p in range(args.processes):
        for code in list(trees)[:: 1 if p % 2 == 0 else -1]:
            prompts.reset()
            got = one_process(code, trees[code], bundle, prompts, args, work)
            rows += [r | {"process": p} for r in got]
            run |= {"wall_s": time.perf_counter() - t0, "load_end": os.getloadavg()[0]}
            result |= {"run": run, "measurements": rows, "best": best(rows)}
            publish(args.out, name, result, markdown(result), echo=False)
    print(markdown(result))


if __name__ == "__main__":
    main()
