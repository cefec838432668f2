"""In-process load: doel's engine and onnxruntime-genai's Engine on the same model.onnx, the same
prompts (ids) and client levels, no HTTP (onnxruntime-genai has no server).

Run by benchmarks/load/bench_load.py, one process per engine and draw:
`python -m benchmarks.load.bench_load_inproc doel|genai|ceiling BUNDLE SPEC.json OUT.json`
(`ceiling`: doel's engine timing its prefill and steps alone, what bench_load_report compares
with the HTTP levels). The `genai` side runs in its own virtualenv (onnxruntime-genai's newest
release pins a builder the export extra cannot take), so this module imports only the standard
library and benchmarks.load.load_client at its top. Clients are closed loops as over HTTP: each
sends `rounds` requests in turn, the next when the last is done, greedy, `new_tokens` each.

onnxruntime-genai's continuous batching (`engine.dynamic_batching`) needs a PagedAttention graph
("Paged cache input must have rank four ...": the export's GroupQueryAttention graph is refused),
so on this model.onnx its Engine runs its static batching: requests that arrive while a batch
runs wait for it to finish. Its config is written into a temporary folder of links to the bundle's
files (the bundle itself is never touched).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.load.load_client import Outcome, summarize


def _record(out: Outcome, t0: float, now: float) -> None:
    """One id arrived at `now` for the request sent at t0."""
    if out.ttft is None:
        out.ttft = now - t0
    else:
        out.gaps.append(now - t0 - out.end)
    out.end = now - t0
    out.tokens += 1


def run_doel(bundle: str, spec: dict) -> list[dict]:
    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.prefix import Hit
    from doel.serve.core.sampling import SamplingParams
    from doel.serve.core.scheduler import Scheduler

    engine = Engine(read_bundle(bundle), threads=spec["threads"], slots=spec["slots"])
    engine.warm_up()
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0)
    prompts = iter(spec["prompts"])

    async def request(scheduler, client: int) -> Outcome:
        out, t0 = Outcome(client=client), time.perf_counter()
        async for _ in scheduler.generate(next(prompts), params, hit=Hit()):
            _record(out, t0, time.perf_counter())
        out.latency = time.perf_counter() - t0
        return out

    async def level(scheduler, n: int) -> dict:
        async def client(i):
            return [await request(scheduler, i) for _ in range(spec["rounds"])]

        t0 = time.perf_counter()
        done = [o for got in await asyncio.gather(*map(client, range(n))) for o in got]
        return summarize(done, time.perf_counter() - t0) | {"clients": n}

    async def main():
        scheduler = Scheduler(engine, max_queue=256)
        await asyncio.gather(request(scheduler, 0), request(scheduler, 1))  # warm-up
        points = [await level(scheduler, n) for n in spec["levels"]]
        await scheduler.close()
        return points

    return asyncio.run(main())


def ceiling(prefill_s: float, step_s: float, clients: int, new_tokens: int) -> float:
    """The most tokens/s `clients` closed-loop clients can get from an engine that prefills a
    prompt in `prefill_s` and steps `clients` rows in `step_s`: each request costs its prefill
    (which gives its first token) and its share of new_tokens - 1 full steps, and runs never
    overlap (one session holds every core). A step of fewer rows costs less but serves fewer
    tokens, so for any scheduling this is an upper bound when tokens per step-second grow with
    the rows (they do: benchmarks/results/profile_serve_0.4b_cpu-*.md)."""
    return clients * new_tokens / (clients * prefill_s + (new_tokens - 1) * step_s)


BURSTS, BURST_STEPS = 4, 8  # each level's steps, in bursts taking turns with the other levels'


def run_ceiling(bundle: str, spec: dict) -> list[dict]:
    """The engine alone: its prefill of one prompt and its step of c rows (each row mid-answer),
    the best of each, and ceiling(). A host's speed drifts over minutes, so each level's steps
    come in BURSTS taking turns with the other levels' (a pause like a server's between steps),
    with a prefill timed after each round: one slow spell does not set a level's figure. It is
    still one process's estimate, and a served process may run faster."""
    from doel.serve.core.engine import Engine, read_bundle

    engine = Engine(read_bundle(bundle), threads=spec["threads"], slots=spec["slots"])
    engine.warm_up()
    prompts, new = spec["prompts"], spec["new_tokens"]

    def prefill(slot: int) -> float:
        t0 = time.perf_counter()
        engine.forward(list(prompts[slot % len(prompts)]), 0, slot=slot)
        return time.perf_counter() - t0

    # every row a prompt of its own, as the clients send (the first run of a slot's pages once)
    prefills = [prefill(slot) for slot in range(max(spec["levels"]))][1:]
    length = len(prompts[0]) + new // 2  # the mean context of a row's answer
    steps: dict[int, list[float]] = {c: [] for c in spec["levels"]}
    for _ in range(BURSTS):
        for c in spec["levels"]:
            for _ in range(BURST_STEPS):
                t0 = time.perf_counter()
                engine.decode([0] * c, [length] * c)
                steps[c].append(time.perf_counter() - t0)
                time.sleep(0.001)
        prefills.append(prefill(0))
    best = min(prefills)
    return [
        {
            "clients": c,
            "prefill_ms": best * 1e3,
            "step_ms": min(steps[c]) * 1e3,
            "aggregate_tok_s": ceiling(best, min(steps[c]), c, new),
        }
        for c in spec["levels"]
    ]


def genai_folder(bundle: Path, spec: dict, into: Path) -> Path:
    """Links to the bundle's files and a genai_config.json for the Engine: the bundle's own,
    with spec's threads, greedy search, and static batching of spec's slots."""
    for f in bundle.iterdir():
        if f.name != "genai_config.json":
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((bundle / "genai_config.json").read_text())
    opts = cfg["model"]["decoder"]["session_options"]
    opts |= {"intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}
    cfg["search"] |= {"do_sample": False, "max_length": cfg["model"]["context_length"]}
    cfg["engine"] = {"static_batching": {"max_batch_size": spec["slots"]}}
    (into / "genai_config.json").write_text(json.dumps(cfg))
    return into


def run_genai(bundle: str, spec: dict) -> list[dict]:
    import numpy as np
    import onnxruntime_genai as og

    with tempfile.TemporaryDirectory() as tmp:
        model = og.Model(str(genai_folder(Path(bundle), spec, Path(tmp))))
    engine = og.Engine(model)
    buf = engine.create_event_buffer(256)
    prompts = iter(spec["prompts"])
    token, finished = og.EngineEventFlags.TOKEN, og.EngineEventFlags.TURN_FINISHED
    failed = og.EngineEventFlags.FAILED

    def submit(client: int, live: dict) -> None:
        req = engine.create_request()
        turn = og.TurnOptions(req)
        turn.set_do_sample(False)
        turn.set_max_generated_tokens(spec["new_tokens"])
        req.begin_turn(np.asarray(next(prompts), dtype=np.int32), turn)
        live[id(req)] = (req, Outcome(client=client), time.perf_counter())

    def level(n: int, rounds: int) -> list[Outcome]:
        live, done, left = {}, [], {i: rounds for i in range(n)}
        for i in range(n):
            submit(i, live)
        while live:
            engine.run(buf)
            now = time.perf_counter()
            for k in range(len(buf)):
                ev = buf[k]
                req, out, t0 = live[id(ev.request)]
                if ev.flags & token:
                    _record(out, t0, now)
                if ev.flags & (finished | failed):
                    out.latency = now - t0
                    out.error = f"failed: {ev.error_code}" if ev.flags & failed else None
                    done.append(out)
                    del live[id(ev.request)]
                    req.close()
                    left[out.client] -= 1
                    if left[out.client]:
                        submit(out.client, live)
        return done

    level(2, 1)  # warm-up
    points = []
    for n in spec["levels"]:
        t0 = time.perf_counter()
        outs = level(n, spec["rounds"])
        points.append(summarize(outs, time.perf_counter() - t0) | {"clients": n})
    return points


def main(argv: list[str]) -> None:
    engine, bundle, spec_path, out = argv
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    points = {"doel": run_doel, "genai": run_genai, "ceiling": run_ceiling}[engine](bundle, spec)
    with open("/proc/self/status") as f:
        peak = next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmHWM:"))
    result = {"engine": engine, "points": points, "peak_rss_mb": peak}
    if engine == "genai":
        import onnxruntime_genai as og

        result["version"] = og.__version__
    result["process_s"] = time.perf_counter() - t0
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
