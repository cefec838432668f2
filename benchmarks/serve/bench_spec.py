"""Prompt-lookup drafting in doel-serve against llama-server's ngram drafting, on a real model.

SmolLM2-135M-Instruct imported (benchmarks/load/load_model.py, `--model smollm2-135m`: the int4
bundle at doel-export's defaults and llama.cpp's q4_0 GGUF of it), greedy chat completions of
up to NEW ids on five kinds of request, PER_TASK of each, made from the shared validation text:
copying a Bangla passage, copying an English one, summarizing an English one, rewriting a JSON
object's keys, and free chat with no passage (where a reply repeats little). Two parts:
- **the draft length**, in one process on doel's engine and scheduler (one client, no HTTP):
  each of DRAFTS as `draft_tokens` over the same requests, taking turns on each request, each
  request's best of SWEEP_ROUNDS: ids per second, drafts kept, and whether each reply's ids
  equal those of no drafting (docs/serving.md says why they can differ on 4- and 8-bit kernels);
- **the servers**, over HTTP with 1 and 8 clients (benchmarks/load/load_servers.py's settings):
  doel-serve with drafting off and at its default, llama-server without drafting, with
  `--spec-type ngram-simple` at its defaults, and at doel's shape (lookup of 3, drafts of 6);
  aggregate output ids per second, drafts kept (doel-serve's /metrics, llama-server's timings),
  replies equal to the same server's undrafted ones. `--processes N` runs each server N times,
  interleaved, the order turned every round; the best process counts. `--part sweep` or
  `--part servers` measures one part and keeps the other from the class's result. With eight
  clients the batch a reply's ids are computed in depends on timing, so its ids may differ
  between two runs of the same server (4- and 8-bit kernels round each batch size differently).

Writes benchmarks/results/spec_smollm2-135m_cpu-<class>.{json,md,png}
(benchmarks/serve/bench_spec_report.py). Run: `make bench-spec` (about 9 minutes a process;
the models are made once in ~/.cache/doel/bench-load-smollm2-135m, and llama-server is built
once, as bench_load builds it).
"""

from __future__ import annotations

import asyncio
import json
import time
import unicodedata
import urllib.request
from pathlib import Path

from benchmarks.common import report
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.load.load_client import CHAT_PATH, Outcome, run_level
from benchmarks.load.load_model import prepare, split_files
from benchmarks.load.load_servers import CACHE, Server, install_llama_server
from benchmarks.serve.bench_spec_report import figure, markdown

RESULTS = ("spec_smollm2-135m_cpu-<class>",)

PER_TASK = 8  # requests of each kind: 8 clients send EACH each (`eights`), one ONE_CLIENT
ONE_CLIENT = 4
EACH = 3  # requests each of eight clients sends in turn
NEW = 128
DRAFTS = (0, 2, 3, 4, 5, 6, 8)
SWEEP_ROUNDS = 3
SERVERS = {  # name: (kind, extra flags)
    "doel-serve, no drafts": ("doel", ("--draft-tokens", "0")),
    "doel-serve, default": ("doel", ()),
    "llama-server, no drafts": ("llama", ()),
    "llama-server, ngram-simple": ("llama", ("--spec-type", "ngram-simple")),
    "llama-server, ngram-simple 3/6": (
        "llama",
        (
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            "3",
            "--spec-ngram-simple-size-m",
            "6",
            "--spec-draft-n-max",
            "6",
        ),
    ),  # fmt: skip
}
QUESTIONS = (  # free chat: this project's own questions, no passage to repeat
    "What are three good habits for a student preparing for exams?",
    "Explain in simple words why the sky looks blue during the day.",
    "Give me a short plan for a rainy Sunday at home.",
    "Why do people in Bangladesh celebrate Pohela Boishakh?",
    "Write a short poem about a magpie-robin singing in the morning.",
    "How can I save money when I cook for a family of four?",
    "What should a beginner know before learning to swim?",
    "Describe a busy market in Dhaka in a few sentences.",
)
KEYS = ("user_name", "home_city", "favourite_book", "first_language", "job_title", "start_year")


def passages(lang: str, lo: int, hi: int, n: int) -> list[str]:
    """`n` lines of the validation text of `lang` between lo and hi characters (NFC), spread
    over it."""
    text = "\n".join(f.read_text("utf-8") for f in split_files("validation")[lang])
    lines = [unicodedata.normalize("NFC", x.strip()) for x in text.splitlines()]
    fit = [x for x in lines if lo <= len(x) <= hi and not x.startswith("=")]
    if len(fit) < n:
        raise SystemExit(f"the {lang} validation text has {len(fit)} lines of {lo}-{hi} chars")
    return [fit[i * len(fit) // n] for i in range(n)]


def requests() -> dict[str, list[str]]:
    """{task: PER_TASK user messages}."""
    bn, en = passages("bn", 120, 260, PER_TASK), passages("en", 300, 600, 2 * PER_TASK)
    words = [w.strip(".,;:\"'()") for p in en for w in p.split() if w.isalpha() and len(w) > 3]
    jsons = [
        json.dumps({k: words[(7 * i + j) % len(words)] for j, k in enumerate(KEYS)}, indent=2)
        for i in range(PER_TASK)
    ]
    return {
        "copy-bn": [f"Copy this Bangla passage exactly, word for word:\n\n{p}" for p in bn],
        "copy-en": [f"Copy this passage exactly, word for word:\n\n{p}" for p in en[:PER_TASK]],
        "summarize-en": [f"Summarize this passage in two sentences:\n\n{p}" for p in en[PER_TASK:]],
        "json": [
            f"Rewrite this JSON object with every key in camelCase, keeping the values:\n\n{j}"
            for j in jsons
        ],  # fmt: skip
        "chat": list(QUESTIONS),
    }


def sweep(bundle: Path, asks: dict[str, list[str]]) -> list[dict]:
    """One client on doel's scheduler: each draft length over the same requests, the lengths
    taking turns on each request (the order turned every time), each request's best of
    SWEEP_ROUNDS."""
    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams
    from doel.serve.core.scheduler import Scheduler
    from doel.serve.core.template import ChatTemplate, generation_stops

    engine = Engine(read_bundle(bundle), threads=2, slots=1)
    engine.warm_up()
    chat, stops = ChatTemplate.load(bundle), generation_stops(bundle)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=stops)
    scheds = {d: Scheduler(engine, draft_tokens=d, prefix_keep=0.0) for d in DRAFTS}
    got: dict[tuple, dict] = {}  # (draft, task, request) -> ids, best seconds, drafted, kept
    turn = 0
    for _ in range(SWEEP_ROUNDS):
        for task, msgs in asks.items():
            for i, m in enumerate(msgs[:ONE_CLIENT]):
                prompt = chat.ids([{"role": "user", "content": m}])
                turn += 1
                for d in DRAFTS[turn % len(DRAFTS) :] + DRAFTS[: turn % len(DRAFTS)]:
                    s = scheds[d]
                    d0, a0, t0 = s.drafted, s.accepted, time.perf_counter()
                    out = asyncio.run(_ids(s, prompt, params))
                    took = time.perf_counter() - t0
                    was = got.get((d, task, i))
                    if was is None:
                        got[(d, task, i)] = {"ids": out, "s": took, "drafted": s.drafted - d0,
                                             "kept": s.accepted - a0}  # fmt: skip
                    else:
                        was["s"] = min(was["s"], took)
    rows = []
    for d in DRAFTS:
        for task in asks:
            runs = [got[(d, task, i)] for i in range(ONE_CLIENT)]
            base = [got[(0, task, i)]["ids"] for i in range(ONE_CLIENT)]
            made = sum(len(r["ids"]) for r in runs)
            rows.append({"draft_tokens": d, "task": task, "tok_s": made / sum(r["s"] for r in runs),
                         "tokens": made, "drafted": sum(r["drafted"] for r in runs),
                         "accepted": sum(r["kept"] for r in runs),
                         "same": sum(r["ids"] == b for r, b in zip(runs, base)),
                         "of": ONE_CLIENT})  # fmt: skip
            print(f"  draft {d} {task}: {rows[-1]['tok_s']:.1f} ids/s", flush=True)
    return rows


async def _ids(s, prompt: list[int], params) -> list[int]:
    return [t async for t in s.generate(prompt, params, cache=None)]


def drafts_of(port: int) -> tuple[int, int]:
    """doel-serve's draft counters from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    got = dict(line.split() for line in text.splitlines() if line.startswith("doel_draft"))
    return int(got["doel_draft_tokens_total"]), int(got["doel_draft_tokens_accepted_total"])


def eights(msgs: list[str]) -> list[list[str]]:
    """Eight clients' requests: client i sends requests i, i + 1 and i + 2 in turn (a level of
    one request each is decided by its longest reply alone)."""
    return [[msgs[(i + j) % len(msgs)] for j in range(EACH)] for i in range(len(msgs))]


def serve_process(name: str, model: Path, asks: dict, work: Path) -> list[dict]:
    """One server process of SERVERS[name]: every task at 1 and 8 clients."""
    kind, extra = SERVERS[name]
    srv = Server(kind, model, work / f"{kind}.log", extra)
    rows = []
    try:
        srv.wait_ready()
        body = {"max_tokens": NEW, "temperature": 0, "stream_options": {"include_usage": True}}
        for clients in (1, 8):
            for task, msgs in asks.items():
                lists = [msgs[:ONE_CLIENT]] if clients == 1 else eights(msgs)
                before = drafts_of(srv.port) if kind == "doel" else (0, 0)
                outs: list[Outcome] = []
                level = asyncio.run(run_level("127.0.0.1", srv.port, clients, lists, body,
                                              path=CHAT_PATH, outcomes=outs))  # fmt: skip
                if kind == "doel":
                    after = drafts_of(srv.port)
                    drafted, accepted = after[0] - before[0], after[1] - before[1]
                else:
                    drafted, accepted = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
                outs.sort(key=lambda o: (o.client, o.turn))
                rows.append({"server": name, "clients": clients, "task": task,
                             "tok_s": level["aggregate_tok_s"], "errors": level["errors"],
                             "ttft_ms_p50": level["ttft_ms_p50"], "drafted": drafted,
                             "accepted": accepted, "texts": [o.text for o in outs]})  # fmt: skip
                rate = level["aggregate_tok_s"]
                errors = level["errors"]
                print(f"  {name}, {clients} clients, {task}: {rate:.1f} ids/s, "
                      f"{accepted}/{drafted} kept, errors {errors}", flush=True)  # fmt: skip
    finally:
        srv.close()
    return rows


def best(rows: list[dict]) -> list[dict]:
    """Each (server, clients, task)'s row of the process with the best ids per second."""
    top: dict[tuple, dict] = {}
    for r in rows:
        key = (r["server"], r["clients"], r["task"])
        if key not in top or r["tok_s"] > top[key]["tok_s"]:
            top[key] = r
    return list(top.values())


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__)
    p.add_argument("--processes", type=int, default=1, help="processes of each server")
    p.add_argument("--work", default=str(CACHE / "bench-load-smollm2-135m"))
    parts = ("all", "sweep", "servers")
    help_ = "measure one part, kept beside the other in the class's result"
    p.add_argument("--part", choices=parts, default="all", help=help_)
    p.add_argument("--render", help="a result JSON to write as Markdown and PNG again")
    args = p.parse_args(argv)
    if args.render:
        report.render_again(args.render, markdown, figure)
        return
    work = Path(args.work)
    made = prepare(work, [("int4", "q4_0")], "smollm2-135m")
    asks = requests()
    result = report.stamp() | {
        "model": "SmolLM2-135M-Instruct: doel int4 (defaults) / llama.cpp q4_0",
        "new_tokens": NEW, "per_task": PER_TASK, "one_client": ONE_CLIENT, "each": EACH,
        "sweep_rounds": SWEEP_ROUNDS, "requests": asks,
    }  # fmt: skip
    name = f"spec_smollm2-135m_cpu-{result['cpu']['class']}"
    earlier = Path(args.out) / f"{name}.json"
    if args.part != "all" and earlier.is_file():
        kept = json.loads(earlier.read_text(encoding="utf-8"))
        other = ("servers", "server_runs", "servers_run", "processes")
        other = ("sweep", "sweep_run") if args.part == "servers" else other
        result |= {k: kept[k] for k in other if k in kept}
    if args.part in ("all", "sweep"):
        print("draft lengths, one client, in process:", flush=True)
        t0 = time.perf_counter()
        result["sweep"], foreign = foreign_cpu(sweep, made["int4"], asks)
        result["sweep_run"] = run_stamp(foreign, time.perf_counter() - t0)
    if args.part in ("all", "servers"):
        install_llama_server()  # cached: built once (about 10 minutes on 2 cores)
        t0 = time.perf_counter()
        served, foreign = foreign_cpu(serve_all, made, asks, work, args.processes)
        result |= {"servers": best(served), "processes": args.processes,
                   "server_runs": [{k: v for k, v in r.items() if k != "texts"} for r in served],
                   "servers_run": run_stamp(foreign, time.perf_counter() - t0)}  # fmt: skip
    if "sweep" not in result or "servers" not in result:
        raise SystemExit(f"{earlier} lacks the other part: run --part all, or the other part")
    report.publish(args.out, name, result, markdown(result), figure(result))


def run_stamp(foreign: float, wall: float) -> dict:
    return {"date": report.stamp()["date"], "foreign_cpu_s": foreign, "wall_s": wall,
            "machine_load": report.load_line()}  # fmt: skip


def serve_all(made: dict, asks: dict, work: Path, processes: int) -> list[dict]:
    """Every server of SERVERS, `processes` times, the order turned every round."""
    served = []
    for round_ in range(processes):
        for name in list(SERVERS)[:: -1 if round_ % 2 else 1]:
            model = made["int4" if SERVERS[name][0] == "doel" else "q4_0"]
            served += serve_process(name, model, asks, work)
    return served


if __name__ == "__main__":
    main()
