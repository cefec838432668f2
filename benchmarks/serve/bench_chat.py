"""A chat's second turn: time to first token with the prefix cache against llama.cpp's.

Time to first token of the second turn with the prefix cache, against the first turn and
against llama.cpp's prompt cache on the same weights, one run.

Same 0.4B random-weight model as bench_serve.py (its `setup` builds or reuses the checkpoint, the
int4 bundle and the q4_0 GGUF in --work), same 2 threads, each engine alone in a fresh process:
- doel: serve/core/scheduler.py with 4 slots (as `doel-serve`), token ids in. Every conversation's
  first turn goes in first, then every second turn, so each must find its own slot among the
  others (serve/core/prefix.py's choice). Then the second turns once more with the cache off: the
  same prompt prefilled whole.
- llama.cpp+fa (flash attention on, llama.cpp's default on a CPU; `--engines` adds llama.cpp
  without it): llama-cpp-python's `Llama.generate`, which keeps the longest common prefix of
  the new prompt and its context (what the llama.cpp server's `cache_prompt` does for a slot);
  one context, so each conversation's two turns run back to back, and its first turn starts
  from an empty cache (`reset`).
A conversation: a system message and a question rendered by the bundle's chat template (~970
tokens of Bangla sample text), a greedy reply of REPLY tokens, then the second question: turn 2
is turn 1 + the engine's own reply ids + `<|end|><|user|>...<|end|><|assistant|>`. Time to first
token is from the request to its first id; each figure is the best of the conversations.

Run: `python -m benchmarks.serve.bench_chat --work DIR` (the 0.4B model is built on the first run, a
few minutes; llama-cpp-python must be installed, see bench_serve.py; `--resume` keeps the
engines that a run stopped midway had measured). Writes
benchmarks/results/chat_0.4b_cpu-<class>.{json,md}, with the CPU and the machine's load.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common.report import command, parser, publish, stamp

RESULTS = ("chat_0.4b_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]

THREADS = 2
CONVERSATIONS = 2
HISTORY = 970  # tokens of turn 1's prompt
REPLY = 32  # tokens of the reply to turn 1
QUESTIONS = ("এই লেখাটির মূল কথা কী? সংক্ষেপে বলো।", "আরেকটু বিস্তারিত বলো, উদাহরণ দিয়ে।")


def conversations(bundle: Path) -> dict:
    """Turn-1 prompts and the turn-2 suffix, as ids of the bundle's chat template."""
    from doel.serve.core.template import ChatTemplate

    tmpl = ChatTemplate.load(bundle)
    if tmpl is None:
        raise SystemExit(f"{bundle} has no chat template; rebuild the work folder")
    text = (ROOT / "train" / "sample" / "bn.txt").read_text(encoding="utf-8")
    ids, start = [], 0
    for _ in range(CONVERSATIONS):
        lo, hi = start, len(text)
        while hi - lo > 1:  # the longest slice whose conversation fits HISTORY tokens
            mid = (lo + hi) // 2
            system = {"role": "system", "content": text[start:mid]}
            n = len(tmpl.ids([system, {"role": "user", "content": QUESTIONS[0]}]))
            lo, hi = (mid, hi) if n <= HISTORY else (lo, mid)
        system = {"role": "system", "content": text[start:lo]}
        ids.append(tmpl.ids([system, {"role": "user", "content": QUESTIONS[0]}]))
        start = lo
    second = tmpl.ids([{"role": "user", "content": QUESTIONS[1]}])[1:]  # no <|bos|>
    return {"turn1": ids, "suffix": [tmpl.specials["<|end|>"], *second]}


# ------------------------------------------------------------------ engines, in a child process


def doel_child(bundle: str, spec: dict) -> dict:
    from doel.serve.core.prefix import Hit
    from doel.serve.core.sampling import SamplingParams
    from doel.serve.core.service import Service

    svc = Service.load(bundle, threads=THREADS, slots=4)
    params = SamplingParams(max_tokens=REPLY, temperature=0.0)

    async def turn(prompt: list[int]) -> tuple[float, list[int], int]:
        hit, ids, t0, first = Hit(), [], time.perf_counter(), 0.0
        async for token in svc.scheduler.generate(prompt, params, hit=hit):
            first = first or time.perf_counter() - t0
            ids.append(token)
        return first, ids, hit.tokens

    async def main() -> dict:
        ones = [await turn(p) for p in spec["turn1"]]
        seconds = [p + one[1] + spec["suffix"] for p, one in zip(spec["turn1"], ones)]
        twos = [await turn(p) for p in seconds]
        svc.scheduler.prefixes.enabled = False  # from here on nothing is reused
        colds = [await turn(p) for p in seconds]
        # Where the greedy ids first differ, cached against not (None: nowhere). The reused
        # entries were computed one token a step, the uncached ones in 128-token chunks: the
        # same numbers up to rounding, which can flip a near tie of a random model's logits.
        differ = [
            next((i for i, (a, b) in enumerate(zip(two[1], cold[1])) if a != b), None)
            for two, cold in zip(twos, colds)
        ]
        return rows(ones, twos, spec["turn1"], seconds) | {
            "turn2_uncached_ttft_s": min(c[0] for c in colds),
            "turn2_first_difference_cached_vs_not": differ,
        }

    return asyncio.run(main())


def llama_child(gguf: str, spec: dict, flash_attn: bool) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        gguf,
        n_ctx=2048,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        flash_attn=flash_attn,
        verbose=False,
    )

    def turn(prompt: list[int]) -> tuple[float, list[int], int]:
        ids, t0, first = [], time.perf_counter(), 0.0
        held = list(llm._input_ids[: llm.n_tokens])  # what its context holds, as generate sees
        cached = next(
            (i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt))
        )
        gen = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
        for token in gen:
            first = first or time.perf_counter() - t0
            ids.append(token)
            if len(ids) == REPLY:
                break
        gen.close()
        return first, ids, cached

    ones, twos, seconds = [], [], []
    for p in spec["turn1"]:
        llm.reset()  # an empty cache: generate finds no prefix
        ones.append(turn(p))
        seconds.append(p + ones[-1][1] + spec["suffix"])
        twos.append(turn(seconds[-1]))
    return rows(ones, twos, spec["turn1"], seconds)


def rows(ones: list, twos: list, firsts: list, seconds: list) -> dict:
    return {
        "turn1_prompt_tokens": [len(p) for p in firsts],
        "turn1_ttft_s": min(o[0] for o in ones),
        "turn2_ttft_s": min(t[0] for t in twos),
        "turn2_prompt_tokens": [len(p) for p in seconds],
        "turn2_cached_tokens": [t[2] for t in twos],
        "runs": {"turn1_ttft_s": [o[0] for o in ones], "turn2_ttft_s": [t[0] for t in twos]},
    }


# ------------------------------------------------------------------ the run


def measure(engine: str, model: Path, spec_path: Path, work: Path) -> dict:
    from benchmarks.export.bench_export import foreign_cpu

    out = work / f"chat-{engine}.json"

    def run() -> dict:
        cmd = command("serve.bench_chat", "--child", engine, model, spec_path, out)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        return json.loads(out.read_text())

    t0 = time.perf_counter()
    res, foreign = foreign_cpu(run)
    row = res | {"foreign_cpu_s": round(foreign, 1), "wall_s": round(time.perf_counter() - t0, 1)}
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if "error" not in row:  # kept for --resume
        (work / f"chat-{engine}.row.json").write_text(json.dumps(row))
    return row


def markdown(r: dict) -> str:
    lines = [
        f"# Chat: time to first token of turn 2, prefix cache ({r['date']})",
        "",
        f"CPU: {r['cpu']['model_name']} ({r['cpu']['class']}), {THREADS} threads; load average "
        f"{r['load_before']} before, {r['load_after']} after (other agents share the machine: "
        "the ratios within this run are what count). 0.4B random weights, int4 (doel) and "
        f"q4_0 (llama.cpp); {CONVERSATIONS} conversations, turn 1 ~{HISTORY} tokens, a "
        f"{REPLY}-token reply; best of the conversations.",
        "",
        "| engine | turn 1 TTFT | turn 2 TTFT | turn 2 / turn 1 | turn-2 tokens (cached) "
        "| other CPU s | load after |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in r["engines"].items():
        if "error" in e:
            lines.append(f"| {name} | error | | | | | |")
            continue
        cached = ", ".join(
            f"{n} ({c})" for n, c in zip(e["turn2_prompt_tokens"], e["turn2_cached_tokens"])
        )
        lines.append(
            f"| {name} | {e['turn1_ttft_s'] * 1e3:.0f} ms | {e['turn2_ttft_s'] * 1e3:.0f} ms | "
            f"{e['turn2_ttft_s'] / e['turn1_ttft_s']:.3f} | {cached} | {e['foreign_cpu_s']} "
            f"| {e.get('load_after', '')} |"
        )
    doel = r["engines"]["doel"]
    if "turn2_uncached_ttft_s" in doel:
        lines += [
            "",
            f"doel's turn 2 with the cache off (the same prompt prefilled whole): "
            f"{doel['turn2_uncached_ttft_s'] * 1e3:.0f} ms; the first greedy id that differs "
            f"between cached and not, per conversation (None: none of the {REPLY}): "
            f"{doel['turn2_first_difference_cached_vs_not']}.",
        ]
    lines += ["", "| target | value | met |", "|---|---|---|"]
    lines += [f"| {t['name']} | {t['value']} | {t['met']} |" for t in r["targets"]]
    return "\n".join(lines) + "\n"


def targets(engines: dict) -> list[dict]:
    doel = engines["doel"]
    out = []
    if "error" not in doel:
        ratio = doel["turn2_ttft_s"] / doel["turn1_ttft_s"]
        out.append({"name": "doel turn 2 / turn 1 <= 0.2", "value": round(ratio, 3)})
        out[-1]["met"] = ratio <= 0.2
        peers = [e["turn2_ttft_s"] for k, e in engines.items() if k != "doel" and "error" not in e]
        if peers:
            vs = doel["turn2_ttft_s"] / min(peers)
            out.append({"name": "doel turn 2 / best llama.cpp turn 2 <= 1", "value": round(vs, 3)})
            out[-1]["met"] = vs <= 1.0
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, work="scratch folder, kept and reused (default: temporary)")
    # llama.cpp's own default turns flash attention on for the CPU ("auto"), and it was the
    # faster of the two to a first token in bench_serve: the peer unless asked otherwise.
    ap.add_argument("--engines", nargs="+", default=["doel", "llama.cpp+fa"],
                    choices=["doel", "llama.cpp", "llama.cpp+fa"])  # fmt: skip
    ap.add_argument(
        "--resume", action="store_true", help="keep the engines a run killed midway measured"
    )
    ap.add_argument("--child", nargs=4, metavar=("ENGINE", "MODEL", "SPEC", "OUT"), help="internal")
    args = ap.parse_args(argv)
    if args.child:
        engine, model, spec, out = args.child
        spec = json.loads(Path(spec).read_text())
        if engine == "doel":
            res = doel_child(model, spec)
        else:
            res = llama_child(model, spec, flash_attn=engine.endswith("+fa"))
        Path(out).write_text(json.dumps(res))
        return
    from benchmarks.serve.bench_serve import FULL, setup

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_chat_"))
    work.mkdir(parents=True, exist_ok=True)
    _ckpt, bundles, ggufs = setup(work, FULL, with_llama=True)
    spec = work / "chat-spec.json"
    if not (args.resume and spec.is_file()):
        for old in work.glob("chat-*.row.json"):
            old.unlink()
        spec.write_text(json.dumps(conversations(bundles["int4"])))
    load_before = [round(x, 2) for x in os.getloadavg()]
    engines = {}
    models = {"doel": bundles["int4"], "llama.cpp": ggufs["q4_0"], "llama.cpp+fa": ggufs["q4_0"]}
    for engine in args.engines:
        model = models[engine]
        kept = work / f"chat-{engine}.row.json"
        if args.resume and kept.is_file():
            engines[engine] = json.loads(kept.read_text()) | {"resumed": True}
            continue
        print(f"measuring {engine} ...", flush=True)
        engines[engine] = measure(engine, model, spec, work)
    result = stamp() | {
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "settings": {"threads": THREADS, "conversations": CONVERSATIONS, "history": HISTORY,
                     "reply": REPLY, "doel": "int4, 4 slots", "llama.cpp": "q4_0"},
        "engines": engines,
        "targets": targets(engines),
    }  # fmt: skip
    publish(args.out, f"chat_0.4b_cpu-{result['cpu']['class']}", result, markdown(result))


if __name__ == "__main__":
    main()
