"""The demo's training on a busy CPU: torch's default threads against the measured choice.

Decided: fit measures its own thread count on its steps (train/threads.py) instead of taking
torch's default, which on a busy 2-core machine made the demo's threads stall each other and miss
its time limit (issue 38); benchmarks/results/demo_load_<class>.md is the evidence, kept
runnable and not run in CI. This runs the demo's own
training (`doel-train fit --config demo` on the demo's shards) four ways in one run, so the
comparison is a ratio under the same background:
- old: OMP_NUM_THREADS set to torch's default (one thread a core), what every run did before;
- new: unset, so fit measures the thread count on its own steps (train/threads.py);
each beside nothing and beside a fixed neighbour: NEIGHBOURS processes spinning on the CPU.
The new policy beside the neighbour runs all the demo's steps (the claim: <= 2 minutes);
the others stop at --budget seconds of training and their time for all steps is projected
from their tokens a second. The machine's load before each run is recorded: other work on
it shows there, and counts towards neither policy.

The report also computes the fair-share bound: the demo's quiet one-thread speed (from the
thread measure's own step times) times the share of the cores a fair scheduler gives one thread
among the neighbour's (cores / (neighbours + 1), at most one core). No thread policy of the
demo's gets a one-thread run past it, so it says how far the target is from what the machine
allows, and how close the policy comes.

Writes benchmarks/results/demo_load_<cpu class>.{json,md}. Run:
`python -m benchmarks.probes.probe_demo_load` (--budget SECONDS, default 40; --neighbours N,
default 4; --render rewrites the Markdown from the JSON).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.report import ROOT, cpu_line, heading, parser, publish, stamp

RESULTS = ("demo_load_<class>",)

# the demo's steps, from its config (a plain `steps = N` line; tomllib is 3.11+)
STEPS = int(re.search(r"^steps = (\d+)", (ROOT / "configs/demo.toml").read_text(), re.M)[1])
TOKENS_PER_STEP = 1024  # configs/demo.toml: batch 8 x 128
CHOICE = re.compile(r"threads: (\d+) \(([\d.]+) s a step; ([^)]*)\)")  # train/threads.py's line
TARGET = 120.0  # seconds for all the demo's steps beside the neighbour (issue 38)


def _spin() -> None:
    while True:
        pass


def make_shards(work: Path) -> Path:
    """The demo's tokenizer and shards (pipeline/demo.py's split of the built-in sample)."""
    shards = work / "shards"
    if (shards / "meta.json").is_file():
        return shards
    from doel.pipeline.demo import DEMO_VOCAB, split_sample
    from doel.train.data.prepare import PrepareConfig, prepare
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    train, held = split_sample(work / "text")
    cfg = TokenizerConfig(vocab_size=DEMO_VOCAB)
    tok = train_tokenizer(resolve_sources(train), cfg, work / "tokenizer", progress=False)
    prepare(tok, train, shards, PrepareConfig(), val=held, progress=False)
    return shards


def train(shards: Path, out: Path, threads: int | None, limit: float) -> dict:
    """One `doel-train fit --config demo` (fresh, checks skipped: their time is not the steps');
    its steps, training seconds and tokens a second from metrics.jsonl."""
    from doel.pipeline.demo import DEMO_VOCAB

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "doel.train", "fit", "--config", "demo", "--data", str(shards)]
    cmd += ["--out", str(out), "--fresh", "--skip-verify"]
    for s in (f"model.vocab_size={DEMO_VOCAB}", f"time_limit={limit}", "checkpoint_every=1000"):
        cmd += ["--set", s]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"fit failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("kind") == "train"][-1]
    chose = [x for x in proc.stdout.splitlines() if x.startswith("threads:")]
    rate = last["tokens"] / last["seconds"]
    return {
        "load_before": round(load, 2),
        "steps": last["step"],
        "seconds": round(last["seconds"], 1),
        "tokens_per_s": round(rate),
        "all_steps_s": round(last["seconds"] * STEPS / last["step"], 1),
        "choices": chose,
    }


def run_case(shards, work, name, threads, neighbours, limit) -> dict:
    """One case, with `neighbours` spinning processes started first and stopped after."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(neighbours)]
    for p in spinners:
        p.start()
    time.sleep(2 if neighbours else 0)  # the neighbour is running before the first step
    try:
        row = train(shards, work / name, threads, limit)
    finally:
        for p in spinners:
            p.terminate()
            p.join()
    row.update(case=name, neighbours=neighbours, threads=threads or "measured")
    print(f"{name}: {row}", flush=True)
    return row


def step_seconds(choices: list[str]) -> dict[int, float]:
    """{threads: seconds a step} from the thread measure's lines (the last one's figures)."""
    found: dict[int, float] = {}
    for line in choices:
        if m := CHOICE.match(line):
            found = {int(m[1]): float(m[2])}
            for part in m[3].split(", "):
                n, _, sec = part.partition(": ")
                found[int(n)] = float(sec.removesuffix(" s"))
    return found


def fair_share(result: dict) -> dict | None:
    """The demo's tokens a second and all steps' time if it got a fair share of the cores as
    one thread beside the neighbour, from its quiet one-thread step time; None without one."""
    quiet = next((r for r in result["cases"] if r["case"] == "new-quiet"), None)
    one = step_seconds(quiet["choices"]).get(1) if quiet else None
    if one is None:
        return None
    cores = int(result["machine"].split(", ")[1].split()[0])
    share = min(1.0, cores / (result["neighbours"] + 1))
    rate = TOKENS_PER_STEP / one * share
    return {
        "quiet_one_thread_tok_s": TOKENS_PER_STEP / one,
        "share": share,
        "tok_s": rate,
        "all_steps_s": steps_of(result) * TOKENS_PER_STEP / rate,
    }


def steps_of(result: dict) -> int:
    """The demo's steps when the result was measured (400 before the key was recorded)."""
    return result.get("demo_steps", 400)


def report(result: dict) -> str:
    rows, steps = {r["case"]: r for r in result["cases"]}, steps_of(result)
    lines = heading("The demo's training on a busy CPU", result)
    lines += [
        cpu_line(result["cpu"]),
        "",
        f"`doel-train fit --config demo` ({steps} steps of 1,024 tokens), beside nothing and "
        f"beside a neighbour of {result['neighbours']} processes spinning on the CPU, with "
        f"torch's default {result['default_threads']} threads (old) and with the thread count "
        "measured on the steps (new, train/threads.py). All steps' time is measured for "
        "new + neighbour and projected from tokens a second for the runs stopped at "
        f"{result['budget']:g} s. Load: the 1-minute load average before each run (other "
        "work on this shared machine included).",
        "",
        "| case | neighbour | threads | load before | steps run | tok/s | all steps |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["cases"]:
        lines.append(
            f"| {r['case']} | {r['neighbours']} | {r['threads']} | {r['load_before']:.1f} | "
            f"{r['steps']} | {r['tokens_per_s']:,} | {r['all_steps_s']:.0f} s |"
        )
    loaded, quiet = rows["new-neighbour"], rows["new-quiet"]
    lines += [
        "",
        f"- Beside the neighbour, new/old speed: "
        f"{loaded['tokens_per_s'] / rows['old-neighbour']['tokens_per_s']:.2f}x; all "
        f"{steps} steps in {loaded['all_steps_s']:.0f} s (target <= {TARGET:.0f} s: "
        f"{'met' if loaded['all_steps_s'] <= TARGET else 'NOT met'}).",
        f"- Beside nothing, new/old speed: "
        f"{quiet['tokens_per_s'] / rows['old-quiet']['tokens_per_s']:.2f}x.",
        "- The new policy's choices: "
        + "; ".join(f"{r['case']}: {' / '.join(r['choices']) or '-'}" for r in result["cases"]),
    ]
    bound = fair_share(result)
    if bound is not None:
        lines.append(
            f"- Fair-share bound beside the neighbour: the quiet one-thread speed "
            f"({bound['quiet_one_thread_tok_s']:,.0f} tok/s) x {bound['share']:.2f} of a core "
            f"(cores / (neighbours + 1)) = {bound['tok_s']:,.0f} tok/s, all {steps} steps in "
            f"{bound['all_steps_s']:.0f} s; the new policy reached "
            f"{loaded['tokens_per_s'] / bound['tok_s']:.0%} of it. The {TARGET:.0f} s target "
            f"{'is within' if bound['all_steps_s'] <= TARGET else 'is past'} the bound."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = parser(__doc__, work="scratch folder (default out/bench-demo-load)")
    ap.add_argument("--budget", type=float, default=40.0, help="training seconds a stopped run")
    ap.add_argument("--neighbours", type=int, default=4, help="spinning processes beside it")
    ap.add_argument("--render", action="store_true", help="rewrite the Markdown from the JSON")
    args = ap.parse_args()
    if args.render:
        from benchmarks.common.cpu_class import this_cpu

        name = f"demo_load_{this_cpu()['class']}"
        result = json.loads((args.out / f"{name}.json").read_text(encoding="utf-8"))
        publish(args.out, name, result, report(result))
        return
    import torch  # the default count, as a fresh process would start with it

    default = torch.get_num_threads()
    work = Path(args.work or ROOT / "out" / "bench-demo-load")
    shards = make_shards(work)
    n, b = args.neighbours, args.budget
    cases = [  # alternating, so a change in the background load hits both policies alike
        run_case(shards, work, "old-quiet", default, 0, b),
        run_case(shards, work, "new-quiet", None, 0, b),
        run_case(shards, work, "old-neighbour", default, n, b),
        run_case(shards, work, "new-neighbour", None, n, 600.0),
    ]
    result = {
        **stamp(python=True),
        "demo_steps": STEPS,
        "neighbours": n,
        "budget": b,
        "default_threads": default,
        "cases": cases,
    }
    name = f"demo_load_{result['cpu']['class']}"
    publish(args.out, name, result, report(result))


if __name__ == "__main__":
    main()
