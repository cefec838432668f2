"""The engines of the serving benchmark, each measured alone in its own process.

`python -m benchmarks.serve.bench_serve_engines ENGINE MODEL SPEC OUT` loads one engine, times its
runs as `SPEC` (a JSON file written by bench_serve.py) says, and writes `OUT` (JSON), including
the process's peak resident memory, which is why every engine gets a fresh interpreter and
imports only what it needs (our engine never imports torch, so torch's memory is not counted
against it):
- `doel`: serve/core/engine.py, the engine of `doel-serve`, on an export bundle; one slot (one
  request at a time, as llama.cpp's context here);
- `doel-sweep`: the same engine with `slots` slots behind serve/core/scheduler.py, streams arriving
  together (the concurrency sweep);
- `llama.cpp` (`llama.cpp+fa`: with flash attention): llama-cpp-python on a GGUF file, through
  `Llama.eval` (prompts in batches of 512), the last position's logits read with
  `llama_get_logits_ith` (with logits_all=False, `Llama.scores` stays empty);
- `torch`: transformers' LlamaForCausalLM in eager fp32 with its KV cache, the prompt's logits
  kept for the last position only (as `generate` does).

Every engine decodes greedily from the same token ids (the tokenizers are not compared: the
GGUF vocabulary is read by llama.cpp's own tokenizer, so ids are passed, not text). Time to first
token is from the call to the first new id; decode speed is the ids after the first over the time
they took. Each figure is the best of the repeats (the least disturbed by other processes).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path


def timed_run(prefill, step, prompt: list[int], new_tokens: int) -> dict:
    """One greedy generation: `prefill(ids) -> id`, then `step(id) -> id` for the rest."""
    t0 = time.perf_counter()
    token = prefill(prompt)
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        token = step(token)
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_tok_s": (new_tokens - 1) / max(t2 - t1, 1e-9)}


def best_of(runs: list[dict]) -> dict:
    return {
        "ttft_s": min(r["ttft_s"] for r in runs),
        "decode_tok_s": max(r["decode_tok_s"] for r in runs),
        "runs": runs,
    }


def doel_runner(bundle: str, threads: int):
    """Our engine's generate loop: prefill, then one step per id, greedy sampling as served."""
    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams

    engine = Engine(read_bundle(bundle), threads=threads, slots=1)
    engine.warm_up()  # as doel-serve does at load (counted in load_s)

    def run(prompt: list[int], new_tokens: int) -> dict:
        # No stop ids: a random model may pick its end-of-sequence id, and every run must
        # produce exactly new_tokens ids.
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
        it = engine.generate(prompt, params)
        state = {}

        def prefill(ids):
            state["t"] = next(it)
            return state["t"]

        def step(_):
            return next(it)

        return timed_run(prefill, step, prompt, new_tokens)

    return run


def load_llama(gguf: str | Path, threads: int, n_ctx: int, **options):
    """llama-cpp-python on a GGUF file, quiet, with the same threads for the prompt and for each
    step: opened one way here and in bench_quant_quality, so that both benchmarks' llama.cpp
    figures come from the same settings. `options`: Llama's other arguments."""
    import llama_cpp

    return llama_cpp.Llama(
        str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **options
    )


def llama_runner(gguf: str, threads: int, n_ctx: int, flash_attn: bool):
    import llama_cpp
    import numpy as np

    llm = load_llama(gguf, threads, n_ctx, flash_attn=flash_attn, logits_all=False)
    n_vocab = llm.n_vocab()

    def next_id() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    def prefill(ids):
        llm.reset()  # the next eval drops the cache past position 0
        llm.eval(ids)
        return next_id()

    def step(token):
        llm.eval([token])
        return next_id()

    return lambda prompt, new_tokens: timed_run(prefill, step, prompt, new_tokens)


def torch_runner(checkpoint: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    state = {}

    @torch.inference_mode()
    def prefill(ids):
        state["cache"] = DynamicCache()
        out = model(torch.tensor([ids]), past_key_values=state["cache"], logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def step(token):
        out = model(torch.tensor([[token]]), past_key_values=state["cache"])
        return int(out.logits[0, -1].argmax())

    return lambda prompt, new_tokens: timed_run(prefill, step, prompt, new_tokens)


def measure(run, spec: dict) -> dict:
    """Warm-up, then the short and the long prompt, each `repeats` times."""
    run(spec["prompts"]["short"][:8], 2)
    out = {}
    for name in ("short", "long"):
        prompt = spec["prompts"][name]
        out[name] = best_of([run(prompt, spec["new_tokens"]) for _ in range(spec["repeats"][name])])
    return out


async def _streams(scheduler, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts submitted at once. A request's latency runs from submission to its last id;
    the decode phase from the moment every stream has its first id (all prompts are in) to
    the last id of all, and its tokens are the ids that came in that span."""
    from doel.serve.core.prefix import Hit
    from doel.serve.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)

    hits = [Hit() for _ in prompts]

    async def one(prompt, hit):
        t0, times = time.perf_counter(), []
        async for _ in scheduler.generate(prompt, params, hit=hit):
            times.append(time.perf_counter())
        return t0, times, time.perf_counter()

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(p, h) for p, h in zip(prompts, hits)))
    all_in = max(times[0] for _, times, _ in done)  # every stream has its first id
    return {
        "wall_s": time.perf_counter() - t0,
        "latencies": [end - start for start, _, end in done],
        "tokens": sum(len(times) for _, times, _ in done),
        "decode_s": max(end for _, _, end in done) - all_in,
        "decode_tokens": sum(t > all_in for _, times, _ in done for t in times),
        "cached_prompt_tokens": sum(h.tokens for h in hits),  # taken from a slot's cache
    }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), numpy's default method."""
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def sweep(bundle: str, spec: dict) -> dict:
    """Aggregate tokens/s and latency percentiles of our scheduler at each stream count, one
    pass over the counts (bench_serve.py runs several such processes and keeps each count's
    best)."""
    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.scheduler import Scheduler

    streams = spec["streams"]
    engine = Engine(read_bundle(bundle), threads=spec["threads"], slots=max(streams))
    engine.warm_up()
    prompts, new = spec["sweep_prompts"], spec["sweep_new_tokens"]

    async def point(scheduler, fresh, n: int) -> dict:
        # One stream alone is measured over several requests in turn, so that its latency
        # percentiles have more than one sample.
        rounds = spec["single_stream_rounds"] if n == 1 else 1
        got = [
            await _streams(scheduler, [next(fresh) for _ in range(n)], new) for _ in range(rounds)
        ]
        walls, lats = sum(g["wall_s"] for g in got), [x for g in got for x in g["latencies"]]
        tokens = sum(g["tokens"] for g in got)
        decode_tokens, decode_s = (sum(g[k] for g in got) for k in ("decode_tokens", "decode_s"))
        return {
            "streams": n,
            "requests": len(lats),
            "tokens": tokens,
            "wall_s": walls,
            "aggregate_tok_s": tokens / walls,
            "decode_phase_tok_s": decode_tokens / decode_s,
            "p50_latency_s": percentile(lats, 50),
            "p95_latency_s": percentile(lats, 95),
            "mean_latency_s": statistics.mean(lats),
            "cached_prompt_tokens": sum(g["cached_prompt_tokens"] for g in got),
        }

    async def main():
        scheduler = Scheduler(engine, max_queue=max(streams))
        fresh = iter(prompts)  # no prompt twice: a cached one would skip its prefill
        await _streams(scheduler, [next(fresh) for _ in range(2)], 2)  # warm-up
        points = [await point(scheduler, fresh, n) for n in streams]
        await scheduler.close()
        return points

    return {"points": asyncio.run(main())}


def peak_rss_mb() -> float:
    """The process's peak resident memory, load and runs together. VmHWM, not ru_maxrss: Linux
    carries ru_maxrss over from the parent through fork and exec, so a child started by a
    benchmark that held 1 GB would report at least 1 GB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


def main(argv: list[str]) -> None:
    engine, model, spec_path, out = argv
    spec = json.loads(Path(spec_path).read_text())
    threads = spec["threads"]
    t0 = time.perf_counter()
    if engine == "doel-sweep":
        result = sweep(model, spec)
    else:
        if engine == "doel":
            run = doel_runner(model, threads)
        elif engine in ("llama.cpp", "llama.cpp+fa"):
            run = llama_runner(model, threads, spec["n_ctx"], flash_attn=engine.endswith("+fa"))
        elif engine == "torch":
            run = torch_runner(model, threads)
        else:
            raise SystemExit(f"unknown engine {engine!r}: doel(-sweep), llama.cpp(+fa) or torch")
        result = {"load_s": time.perf_counter() - t0, **measure(run, spec)}
    result["wall_s"] = time.perf_counter() - t0
    result["peak_rss_mb"] = peak_rss_mb()
    Path(out).write_text(json.dumps(result))  # for bench_serve.py to read, not a report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
