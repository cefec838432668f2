"""Regression check: a seeded request's int4 output beside another tenant's cached prefix.

Does a neighbour's cached prefix change a seeded request's int4 output, and does per-tenant
isolation of the prefix cache remove the case across tenants (issue 36, point 2)?

A seeded sampled request R (temperature and top_p below 1, `seed`) is sent by the tenant
"victim" to a live `doel-serve` of the 0.4B int4 bundle (random weights, the load benchmark's
full-vocabulary tokenizer: benchmarks/load/load_model.py), three ways in each run:
- alone: nothing cached for it;
- after another tenant: "neighbour" first sends N, which shares R's long prefix;
- after the same tenant: "victim" itself sends N first.
Each way runs in a partition of its own (a `cache_salt` per run and way, the same for both
tenants), so every run starts from an empty cache without restarting the server. The server
runs twice, `--prefix-cache per-tenant` (the default) and `shared`. A reused prefix is
prefilled in fewer rows than a whole prompt, so int4's kernels sum in another order and the
logits move by rounding; a sampled token near a boundary of the cumulative distribution can
then flip. Per output: whether its text equals the first alone run's, the cached tokens its
usage reports, and the largest difference of its tokens' log-probabilities from that run's
(over the tokens before the first that differs).

Writes benchmarks/results/seed_isolation_0.4b_cpu-<class>.{json,md}. Run, holding the
benchmark lock: `flock /tmp/doel-bench.lock python -m benchmarks.checks.check_seed_isolation`
(--runs N, default 6: about 8 minutes on 2 cores under a load of 9; the bundle is made once
into --work). Random weights give a nearly flat next-token distribution (its top token ~3e-4),
so any change of the logits flips the sample: the text says whether the logits moved at all,
the log-probabilities by how much.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common.report import ROOT, cpu_line, heading, parser, publish, stamp
from benchmarks.load.load_servers import free_port
from benchmarks.serve.bench_serve_llama import CACHE

RESULTS = ("seed_isolation_0.4b_cpu-<class>",)

MODES = ("per-tenant", "shared")
WAYS = ("alone", "after another tenant", "after the same tenant")
KEYS = {"victim": "victim-key", "neighbour": "neighbour-key"}
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "seed": 7, "max_tokens": 16, "logprobs": 5}
PREFIX_CHARS = 1200  # about 300 tokens of the sample's Bangla: the prefix both requests share


def prompts() -> tuple[str, str]:
    """R and N: one long prefix of the built-in Bangla sample, then different last lines."""
    text = (ROOT / "train" / "sample" / "bn.txt").read_text(encoding="utf-8")
    prefix = " ".join(text.split())[:PREFIX_CHARS]
    return prefix + "\nপ্রশ্ন: নদীর নাম কী?", prefix + "\nপ্রশ্ন: হাট কবে বসে?"


def bundle(work: Path) -> Path:
    """The int4 bundle of the load benchmark (made once, with its q4_0 GGUF twin)."""
    from benchmarks.load.load_model import prepare

    return prepare(work, [("int4", "q4_0")])["int4"]


def post(port: int, key: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=300) as r:
        return json.loads(r.read())


class Served:
    """`doel-serve BUNDLE --prefix-cache MODE` with the two tenants' keys, until closed."""

    def __init__(self, model: Path, mode: str, work: Path):
        self.port = free_port()
        keys = work / "seed-isolation-keys"
        keys.write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()), encoding="utf-8")
        cmd = [sys.executable, "-m", "doel.serve", str(model), "--port", str(self.port),
               "--threads", "2", "--api-key-file", str(keys), "--prefix-cache", mode,
               "--log-level", "warning"]  # fmt: skip
        self.log = open(work / f"seed-isolation-{mode}.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"doel-serve exited ({self.proc.returncode}): {self.log.name}")
            try:
                post(self.port, KEYS["victim"], {"prompt": "আমি", "max_tokens": 2})
                return
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise SystemExit("doel-serve not ready after 300 s") from None
                time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def outcome(answer: dict) -> dict:
    choice = answer["choices"][0]
    return {
        "text": choice["text"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "tokens": choice["logprobs"]["tokens"],
        "first_top": choice["logprobs"]["top_logprobs"][0],
        "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def one_run(port: int, run: int, mode: str) -> dict[str, dict]:
    """R three ways (each in its own partition); {way: outcome}."""
    r, n = prompts()
    first = {"alone": None, "after another tenant": "neighbour", "after the same tenant": "victim"}
    got = {}
    for way in WAYS:
        salt = f"{mode}-{run}-{way}"
        if first[way]:
            post(port, KEYS[first[way]], {"prompt": n, "cache_salt": salt, **SAMPLING})
        got[way] = outcome(
            post(port, KEYS["victim"], {"prompt": r, "cache_salt": salt, **SAMPLING})
        )
    return got


def compare(out: dict, ref: dict) -> dict:
    """Whether `out` is `ref`'s text, and the largest |Δ log-probability| between them: of the
    first token's top 5 both list (the logits after the prompt, whatever was sampled), and of
    the sampled tokens up to the first that differs."""
    a, b = out["first_top"], ref["first_top"]
    delta = max((abs(a[t] - b[t]) for t in a.keys() & b.keys()), default=float("nan"))
    for a, b, ta, tb in zip(out["logprobs"], ref["logprobs"], out["tokens"], ref["tokens"]):
        if ta != tb:
            break
        delta = max(delta, abs(a - b))
    return {"same_text": out["text"] == ref["text"], "max_logprob_delta": delta}


def measure(model: Path, mode: str, runs: int, work: Path) -> dict:
    server = Served(model, mode, work)
    try:
        outs = [one_run(server.port, i, mode) for i in range(runs)]
    finally:
        server.close()
    ref = outs[0]["alone"]
    table = {}
    for way in WAYS:
        rows = [compare(o[way], ref) | {"cached": o[way]["cached"]} for o in outs]
        table[way] = {
            "runs": runs,
            "text_differs": sum(not r["same_text"] for r in rows),
            "distinct_texts": len({o[way]["text"] for o in outs}),
            "max_logprob_delta": max(r["max_logprob_delta"] for r in rows),
            "cached_tokens": sorted({r["cached"] for r in rows}),
            "rows": rows,
        }
    return {"ways": table, "reference_text": ref["text"], "load_after": os.getloadavg()[0]}


def report(result: dict) -> str:
    lines = heading("A neighbour's cache and a seeded int4 request (0.4B)", result)
    lines += [
        cpu_line(result["cpu"]),
        "",
        f"`doel-serve` on the int4 bundle of the 0.4B preset (random weights), 2 threads; the "
        f"seeded request: {json.dumps(SAMPLING)}, a prompt of {result['prompt_tokens']} tokens "
        f"sharing its first ~{PREFIX_CHARS} characters with the neighbour's. {result['runs']} "
        "runs of each way, each in a fresh cache partition; compared with the first alone run.",
        "",
        "| --prefix-cache | way | cached tokens | text differs | distinct texts | "
        "max abs. logprob difference |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for way, w in result["modes"][mode]["ways"].items():
            lines.append(
                f"| {mode} | {way} | {', '.join(map(str, w['cached_tokens']))} | "
                f"{w['text_differs']} of {w['runs']} | {w['distinct_texts']} | "
                f"{w['max_logprob_delta']:.2g} |"
            )
    lines += ["", result["verdict"], "", f"Load: {result['load']}."]
    return "\n".join(lines) + "\n"


def verdict(modes: dict) -> str:
    iso, shared = modes["per-tenant"]["ways"], modes["shared"]["ways"]
    cross, other, own = (
        iso["after another tenant"],
        shared["after another tenant"],
        iso["after the same tenant"],
    )
    alone = all(w["alone"]["text_differs"] == 0 for w in (iso, shared))
    held = cross["text_differs"] == 0 and cross["max_logprob_delta"] == 0
    return (
        f"Alone, the seeded output is the same in every run: {'yes' if alone else 'NO'}. "
        f"With --prefix-cache per-tenant, after another tenant's request on the same prefix "
        f"the output is the alone one "
        f"{'bit for bit in every run, log-probabilities included' if held else 'NOT in every run'}"
        f" (cached tokens {cross['cached_tokens']}): isolation removes the cross-tenant case. "
        f"With a shared cache it reuses the neighbour's prefix (cached tokens "
        f"{other['cached_tokens']}) and its text differs in {other['text_differs']} of "
        f"{other['runs']} runs; within one tenant, where reuse is kept, {own['text_differs']} of "
        f"{own['runs']}. A reused prefix is prefilled in fewer rows, and int4's kernels round "
        f"differently: log-probabilities move by up to {own['max_logprob_delta']:.2g}, enough "
        "to change a sampled token. "
        + (
            "A reused request's output is the same from run to run: what changes it is "
            "whether its prefix was cached."
            if own["distinct_texts"] == other["distinct_texts"] == 1
            else "Reused requests' outputs also differ between runs (see distinct texts)."
        )
    )


def main() -> None:
    ap = parser(
        __doc__, work="the load benchmark's model folder (default ~/.cache/doel/bench-load)"
    )
    ap.add_argument("--runs", type=int, default=6, help="runs of each way, per cache mode")
    args = ap.parse_args()
    work = Path(args.work or CACHE / "bench-load")
    model = bundle(work)
    result = stamp() | {"runs": args.runs, "sampling": SAMPLING, "modes": {}}
    load = [f"{os.getloadavg()[0]:.1f} before"]
    for mode in MODES:
        result["modes"][mode] = measure(model, mode, args.runs, work)
        load.append(f"{result['modes'][mode]['load_after']:.1f} after {mode}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    result["prompt_tokens"] = len(tok.encode(prompts()[0]).ids)
    result["verdict"] = verdict(result["modes"])
    result["load"] = "1-minute load average " + ", ".join(load)
    publish(args.out, f"seed_isolation_0.4b_cpu-{result['cpu']['class']}", result, report(result))


if __name__ == "__main__":
    main()
