"""Where a served token's time goes, per operator, on this CPU (issue 22).

On the 0.4B bundles that bench_serve.py builds (random weights, int4 and int8, `--work` reuses
them), with 2 threads as in the serving benchmark:
- ONNX Runtime's own profiler over decode steps at 1 and 8 rows (every row 128 tokens into its
  sequence) and over a 128-token prefill: milliseconds per step by operator type, the run's total
  as ONNX Runtime sees it, and the wall time of the same steps without the profiler, with the
  part of it spent outside ONNX Runtime's run (binding, the mask, copying the logits out);
- the sampling functions on one row of logits (greedy, and temperature with top-p);
- MatMulNBits alone, the model's three MLP matrices (gate, up, down) chained over all its
  layers (as many bytes as a decode step reads for them; two until issue 57), at int4 blocks
  32-256 and int8 blocks 128 and 256, for 1, 8 and 128 rows: rows served in one row's time is
  the most batching can gain in that operator (a kernel that is compute-bound at 8 rows costs
  per row what it costs at 128).

Where other jobs share the machine, run it with priority (a scheduler autogroup at nice -20:
`setsid bash -c 'echo -20 > /proc/self/autogroup; python -m benchmarks.serve.profile_serve'`): plain
`nice` does not reach across the autogroups of other sessions.
Writes benchmarks/results/profile_serve_0.4b_cpu-<class>.{json,md}. Run after bench_serve.py
(`--work DIR` of a kept run) or alone (it builds the bundles: about 3 minutes).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import (
    SERVE_WORK_HELP,
    cpu_name,
    load_line,
    parser,
    publish,
    render_again,
)
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.serve.bench_serve import FULL, bandwidth, setup
from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.sampling import SamplingParams, sample

RESULTS = ("profile_serve_0.4b_cpu-<class>",)

THREADS = 2
PROMPT = 128
STEPS = 48


def engine(bundle_dir: Path, rows: int, profile: bool) -> Engine:
    e = Engine(read_bundle(bundle_dir), threads=THREADS, slots=rows, profile=profile)
    e.warm_up()
    rng = np.random.default_rng(0)
    for slot in range(rows):
        e.forward(rng.integers(10, 1000, PROMPT).tolist(), 0, slot=slot)
    return e


def decode_steps(e: Engine, rows: int, steps: int) -> tuple[float, float]:
    """Seconds per batched decode step of `rows` rows, wall and this process's CPU time (their
    ratio is how many threads were busy on average)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        e.decode([17] * rows, [PROMPT + 1 + i] * rows)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def by_operator(trace: Path, runs: int) -> dict:
    """Milliseconds per run by operator type, and per run in all (ONNX Runtime's model_run)."""
    events = json.loads(trace.read_text())
    # The profile covers warm-up and the prompts too: keep only the last `runs` model runs' share.
    runs_seen = [ev for ev in events if ev.get("name") == "model_run"]
    last = runs_seen[-runs:]
    lo = last[0]["ts"]
    ops = defaultdict(float)
    for ev in events:
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time") and ev["ts"] >= lo:
            ops[ev["args"]["op_name"]] += ev["dur"] / 1000 / runs
    run_ms = sum(ev["dur"] for ev in last) / 1000 / runs
    return {"run_ms": run_ms, "ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def in_onnxruntime(e: Engine) -> list[float]:
    """Wrap the engine's session runs: the returned list collects the seconds spent in them."""
    run, spent = e.session.run_with_iobinding, []

    def timed(binding):
        t0 = time.perf_counter()
        run(binding)
        spent.append(time.perf_counter() - t0)

    e.session.run_with_iobinding = timed
    return spent


def profile_decode(bundle_dir: Path, rows: int) -> dict:
    plain = engine(bundle_dir, rows, profile=False)
    spent = in_onnxruntime(plain)
    decode_steps(plain, rows, 4)
    best = (1e9, 0.0, 0.0)
    for _ in range(3):
        spent.clear()
        wall, cpu = decode_steps(plain, rows, STEPS)
        best = min(best, (wall, cpu, sum(spent) / STEPS))
    wall, cpu, ort_s = best
    del plain
    prof = engine(bundle_dir, rows, profile=True)
    decode_steps(prof, rows, STEPS)
    trace = Path(prof.session.end_profiling())
    out = by_operator(trace, STEPS) | {
        "wall_ms": wall * 1000,
        "cpu_ms": cpu * 1000,
        "outside_ort_ms": (wall - ort_s) * 1000,  # binding, the mask, copying the logits out
        "rows": rows,
    }
    trace.unlink()
    return out


def profile_decodes(bundle_dir: Path) -> dict:
    return {rows: profile_decode(bundle_dir, rows) for rows in (1, 8)}


def profile_prefill(bundle_dir: Path) -> dict:
    ids = list(range(10, 10 + PROMPT))
    plain = engine(bundle_dir, 1, profile=False)
    walls = []
    for _ in range(4):
        t0 = time.perf_counter()
        plain.forward(ids, 0)
        walls.append(time.perf_counter() - t0)
    del plain
    prof = engine(bundle_dir, 1, profile=True)
    t0 = time.perf_counter()
    for _ in range(3):
        prof.forward(ids, 0)
    wall = (time.perf_counter() - t0) / 3
    trace = Path(prof.session.end_profiling())
    out = by_operator(trace, 3) | {
        "wall_ms_profiled": wall * 1000,
        "wall_ms": min(walls[1:]) * 1000,
        "tokens": PROMPT,
    }
    trace.unlink()
    return out


def sampling_cost(vocab: int) -> dict:
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32) * 3
    rng = np.random.default_rng(1)
    ctx = np.arange(200, dtype=np.int64)
    cases = {
        "greedy": SamplingParams(temperature=0),
        "temperature 0.8": SamplingParams(temperature=0.8),
        "temperature 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
        "top_p 0.95 + repetition 1.1": SamplingParams(
            temperature=0.8, top_p=0.95, repetition_penalty=1.1
        ),
    }
    out = {}
    for name, p in cases.items():
        t0 = time.perf_counter()
        for _ in range(200):
            sample(logits, p, rng, ctx, ctx[100:])
        out[name] = (time.perf_counter() - t0) / 200 * 1000
    return out


def matmul_chain_model(h: int, f: int, layers: int, bits: int, block: int) -> bytes:
    """The model's MLP matrices as MatMulNBits nodes, `layers` times: gate and up ([M, h] -> f,
    both from the layer's input), their product, down (f -> h) to the next layer's input;
    random symmetric weights: as many bytes as the real layers' three MLP matrices (issue 57:
    it held two, gate and down, until then), so that one row reads them from memory as a decode
    step does, not from cache."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x0"
    for i in range(layers):
        layer_in = x
        for j, (k, n) in enumerate(((h, f), (h, f), (f, h))):
            blocks, tag = k // block, f"{i}_{j}"
            data = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
            scales = (rng.random(n * blocks, dtype=np.float32) * 0.01).astype(np.float32)
            inits += [
                onnx.numpy_helper.from_array(data, f"b{tag}"),
                onnx.numpy_helper.from_array(scales, f"s{tag}"),
            ]
            src = f"m{i}" if j == 2 else layer_in
            nodes.append(
                helper.make_node(
                    "MatMulNBits",
                    [src, f"b{tag}", f"s{tag}"],
                    [f"y{tag}"],
                    domain="com.microsoft",
                    K=k,
                    N=n,
                    bits=bits,
                    block_size=block,
                    accuracy_level=4,
                )
            )
            if j == 1:  # gate times up, as the MLP's activation product (its cost: one Mul)
                nodes.append(helper.make_node("Mul", [f"y{i}_0", f"y{i}_1"], [f"m{i}"]))
            x = f"y{tag}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["m", h])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["m", h])],
        inits,
    )
    opset = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opset).SerializeToString()


def matmul_rows(h: int, f: int, layers: int, bits: int, block: int) -> dict:
    """Milliseconds of the chain for 1, 8 and 128 rows (best of 7), and rows served per one-row
    time: what batching can gain in MatMulNBits at that block size."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.inter_op_num_threads = 1
    s = ort.InferenceSession(matmul_chain_model(h, f, layers, bits, block), opts)
    out = {}
    for m in (1, 8, 128):
        a = (np.random.default_rng(m).standard_normal((m, h)) * 0.1).astype(np.float32)
        for _ in range(2):
            s.run(None, {"x0": a})
        out[m] = {"ms": min(_timed(s, a, max(3, 40 // m)) for _ in range(7)) * 1000}
    for m, r in out.items():
        r["rows_per_one_row_time"] = m * out[1]["ms"] / r["ms"]
    return out


def _timed(s, a, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        s.run(None, {"x0": a})
    return (time.perf_counter() - t0) / reps


def int8_gemm_peak(h: int, f: int, layers: int) -> dict:
    """Multiply-accumulates per second of ONNX Runtime's plain int8 GEMM (MatMulInteger, u8 x s8:
    MLAS's QGEMM, VNNI where the CPU has it) at 8, 128 and 512 rows, over the model's MLP
    matrices of every layer (one node each, as many bytes as the MatMulNBits chain at 8 bits,
    so that the weights stream from memory as in a decode step): the machine's int8 rate as
    ONNX Runtime reaches it, against which MatMulNBits' rate is read."""
    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    for i in range(layers):
        for j, (src, k, n) in enumerate((("a", h, f), ("a", h, f), ("c", f, h))):
            w = rng.integers(-127, 128, (k, n), dtype=np.int8)
            inits.append(onnx.numpy_helper.from_array(w, f"w{i}_{j}"))
            nodes.append(helper.make_node("MatMulInteger", [src, f"w{i}_{j}"], [f"y{i}_{j}"]))
            outs.append(helper.make_tensor_value_info(f"y{i}_{j}", TensorProto.INT32, ["m", n]))
    inputs = [
        helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", h]),
        helper.make_tensor_value_info("c", TensorProto.UINT8, ["m", f]),
    ]
    graph = helper.make_graph(nodes, "qgemm", inputs, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    s = ort.InferenceSession(model.SerializeToString(), opts)
    out = {}
    for m in (8, 128, 512):
        feed = {
            "a": rng.integers(0, 256, (m, h), dtype=np.uint8),
            "c": rng.integers(0, 256, (m, f), dtype=np.uint8),
        }
        for _ in range(2):
            s.run(None, feed)
        best = min(_timed_feed(s, feed, max(2, 40 // m)) for _ in range(5))
        out[m] = m * 3 * h * f * layers / best / 1e9
    return out


def _timed_feed(s, feed: dict, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        s.run(None, feed)
    return (time.perf_counter() - t0) / reps


def matmul_blocks(cfg: dict) -> dict:
    h, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    return {
        f"int{bits} block {block}": matmul_rows(h, f, n, bits, block)
        for bits, blocks in ((4, (32, 64, 128, 256)), (8, (128, 256)))
        for block in blocks
    }


def run(work: Path) -> dict:
    setup(work, FULL, with_llama=False)
    t0 = time.time()
    result = {
        "date": date.today().isoformat(),
        "cpu": this_cpu(),
        "threads": THREADS,
        "prompt": PROMPT,
        "steps": STEPS,
        "bundles": {},
    }
    gb_s = [bandwidth(THREADS)["read_gb_s"]]  # for the attention floor: its best reading
    for q in ("int4", "int8"):
        b = work / f"bundle-{q}"
        print(f"profiling {q} ...", flush=True)
        decode, foreign = foreign_cpu(profile_decodes, b)
        result["bundles"][q] = {
            "decode": decode,
            "prefill": profile_prefill(b),
            "foreign_cpu_s": foreign,
        }
    cfg = json.loads((work / "bundle-int4" / "config.json").read_text())
    result["sampling_ms"] = sampling_cost(cfg["vocab_size"])
    result["matmul_nbits"], result["matmul_foreign_cpu_s"] = foreign_cpu(matmul_blocks, cfg)
    result["int8_gemm_gmac_s"] = int8_gemm_peak(
        cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    )
    macs = 3 * cfg["num_hidden_layers"] * cfg["hidden_size"] * cfg["intermediate_size"]
    for rows in result["matmul_nbits"].values():
        for m, r in rows.items():
            r["gmac_s"] = m * macs / r["ms"] / 1e6
    gb_s.append(bandwidth(THREADS)["read_gb_s"])
    result["read_gb_s"], result["read_gb_s_readings"] = max(gb_s), gb_s
    result["ceiling"] = ceiling(result, cfg)
    result["wall_s"] = time.time() - t0
    return result


def reading(r: dict) -> list[str]:
    """What the decode columns say, computed from them: how much an 8-row step serves over a
    one-row step, and which operators the extra time goes to."""
    out = []
    for q, b in r["bundles"].items():
        one, eight = (b["decode"][k] for k in sorted(b["decode"], key=int))
        gain = 8 * one["wall_ms"] / eight["wall_ms"]
        grew = {
            op: eight["ops_ms"].get(op, 0) - one["ops_ms"].get(op, 0)
            for op in ("MatMulNBits", "GroupQueryAttention")
        }
        extra = eight["run_ms"] - one["run_ms"]
        gqa = eight["ops_ms"].get("GroupQueryAttention", 0)
        gqa /= max(one["ops_ms"].get("GroupQueryAttention", 0), 1e-9)
        out.append(
            f"- {q}: an 8-row step serves {gain:.2f}× the tokens of a one-row step in the same "
            f"time. Of the {extra:.1f} ms the profiled 8-row run adds, MatMulNBits takes "
            f"{grew['MatMulNBits']:.1f} and GroupQueryAttention {grew['GroupQueryAttention']:.1f} "
            f"(it grows {gqa:.1f}× "
            "for 8× the rows: its CPU kernel runs one small GEMM per row and head)."
        )
    return out


def linear_macs(cfg: dict) -> int:
    """Multiply-accumulates of one token through every quantized matrix, the head included."""
    h, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    qkv = h * d * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    return n * (qkv + h * h + 3 * h * f) + h * cfg["vocab_size"]


def ratio_ceiling(p: float, t1: float, tn: float, streams: int = 8, d: int = 127) -> float:
    """`streams` streams against one alone, each a prompt (prefill p) and d further steps: one
    stream takes p + d t1, `streams` together at best streams p + d tn, whatever the scheduling
    (a prompt's run and a step's share no weights read)."""
    return streams * (p + d * t1) / (streams * p + d * tn)


def kv_row_bytes(cfg: dict, context: float) -> float:
    """Bytes of fp32 cache one row's attention reads in a decode step at `context` positions."""
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * d * 4 * context


def ceiling(r: dict, cfg: dict, new_tokens: int = 128, streams: int = 8) -> dict:
    """What the measured steps allow the sweep's target (`streams` streams, each a PROMPT-token
    prompt and `new_tokens` new ones, against one stream alone; ratio_ceiling), the n-row step
    that a ratio of 3 needs, the n-row step's matrix work at the int8 GEMM rate this machine
    reaches with streamed weights; with a profile, the same ceiling with parts of the steps
    replaced by what the machine allows (`composed`)."""
    out, d = {}, new_tokens - 1
    rates = {int(k): v for k, v in r.get("int8_gemm_gmac_s", {}).items()}  # JSON: str keys
    peak = rates.get(streams)
    for q, b in r["bundles"].items():
        p = b["prefill"]["wall_ms"]
        t1, tn = (b["decode"][k]["wall_ms"] for k in sorted(b["decode"], key=int))
        one = p + d * t1
        need = (streams * one / 3 - streams * p) / d
        row = {
            "prefill_ms": p,
            "step_1_ms": t1,
            f"step_{streams}_ms": tn,
            "ratio_ceiling": ratio_ceiling(p, t1, tn, streams, d),
            f"step_{streams}_needed_ms": need,
            f"matmul_{streams}_rows_ms": b["decode"][max(b["decode"], key=int)]["ops_ms"].get(
                "MatMulNBits", 0
            ),
        }
        if peak:
            row[f"matmul_{streams}_rows_at_int8_rate_ms"] = streams * linear_macs(cfg) / peak / 1e6
        if "run_ms" in b["prefill"]:  # profiled
            context = r.get("prompt", PROMPT) + (r.get("steps", STEPS) + 1) / 2
            floor = {"gb_s": r.get("read_gb_s"), "row_bytes": kv_row_bytes(cfg, context)}
            row |= composed(b, linear_macs(cfg), max(rates.values(), default=None), floor, d)
        out[q] = row
    return out


def split(x: dict) -> tuple[float, float, float]:
    """A profiled run's wall time as MatMulNBits, GroupQueryAttention and the rest (each op's
    profiled share of the run, applied to the unprofiled wall)."""
    scale = x["wall_ms"] / x["run_ms"]
    mm = x["ops_ms"].get("MatMulNBits", 0) * scale
    attn = x["ops_ms"].get("GroupQueryAttention", 0) * scale
    return mm, attn, x["wall_ms"] - mm - attn


def composed(b: dict, macs: int, gmac_s: float | None, floor: dict, d: int) -> dict:
    """The ceiling again with the machine's limits in place of ONNX Runtime's kernels:
    - at the int8 peak: every quantized matrix at `gmac_s` (the fastest int8 GEMM rate measured
      here: MLAS's QGEMM with many rows, compute-bound, so about what the cores can do), never
      faster than reading the weights once (a step's MatMulNBits time at one row);
    - attention at its floor: GroupQueryAttention as long as reading each row's cache once
      takes at the machine's read bandwidth (`floor`: GB/s and bytes a row), the matrices as
      measured. Under 3, MatMulNBits alone rules the target out, whatever attention kernel;
    - both: what the hardware allows (the rest of every run as profiled).
    Over 3 at the peak, the kernels are the limit, not the hardware."""
    ks = sorted(b["decode"], key=int)
    parts = {k: split(b["decode"][k]) for k in ks}
    w_floor = parts[ks[0]][0]  # the weights read once per step
    p_mm, p_attn, p_rest = split(b["prefill"])
    tokens = b["prefill"].get("tokens", PROMPT)
    n = int(ks[-1])

    def step(k: str, at_peak: bool, attn_floor: bool) -> float:
        mm, attn, rest = parts[k]
        if at_peak:
            mm = max(int(k) * macs / gmac_s / 1e6, w_floor)
        if attn_floor:
            attn = int(k) * floor["row_bytes"] / floor["gb_s"] / 1e6
        return mm + attn + rest

    p_peak = p_rest + p_attn + tokens * macs / gmac_s / 1e6 if gmac_s else None
    out = {f"attention_{n}_rows_ms": parts[ks[-1]][1]}
    if gmac_s:
        t1, tn = step(ks[0], True, False), step(ks[-1], True, False)
        out |= {
            "peak_gmac_s": gmac_s,
            "prefill_at_peak_ms": p_peak,
            f"step_{n}_at_peak_ms": tn,
            f"step_{n}_rest_ms": sum(parts[ks[-1]][1:]),
            "ratio_ceiling_at_peak": ratio_ceiling(p_peak, t1, tn, n, d),
        }
    if floor.get("gb_s"):
        p = b["prefill"]["wall_ms"]
        t1, tn = step(ks[0], False, True), step(ks[-1], False, True)
        out |= {
            "kv_read_gb_s": floor["gb_s"],
            f"attention_{n}_rows_floor_ms": n * floor["row_bytes"] / floor["gb_s"] / 1e6,
            f"step_{n}_attention_floor_ms": tn,
            "ratio_ceiling_attention_floor": ratio_ceiling(p, t1, tn, n, d),
        }
        if gmac_s:
            t1, tn = step(ks[0], True, True), step(ks[-1], True, True)
            out |= {
                f"step_{n}_hardware_ms": tn,
                "ratio_ceiling_hardware": ratio_ceiling(p_peak, t1, tn, n, d),
            }
    return out


def _cells(x: dict, keys: tuple[str, ...]) -> str:
    return " | ".join("–" if x.get(k) is None else f"{x[k]:.2f}" for k in keys)


def ceiling_lines(c: dict) -> list[str]:
    lines = [
        "## What 8 streams ≥ 3× one stream needs",
        "",
        "One stream: prefill P + 127 steps t1; eight: at best 8 P + 127 t8 (bench_serve's sweep: "
        f"{PROMPT}-token prompts, 128 new tokens). Unprofiled walls from above; an operator's "
        "share is its profiled share of the run.",
        "",
        "| bundle | P ms | t1 ms | t8 ms | t8 a ratio of 3 needs | MatMulNBits in an 8-row step "
        "ms | the same MACs at the int8 GEMM rate ms | attention in an 8-row step ms | its floor "
        "ms | the rest of an 8-row step ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    steps = ("step_8_needed_ms", "matmul_8_rows_ms", "matmul_8_rows_at_int8_rate_ms")
    parts = ("attention_8_rows_ms", "attention_8_rows_floor_ms", "step_8_rest_ms")
    for q, x in c.items():
        lines.append(
            f"| {q} | {x['prefill_ms']:.0f} | {x['step_1_ms']:.2f} | {x['step_8_ms']:.2f} | "
            f"{_cells(x, steps)} | {_cells(x, parts)} |"
        )
    lines += [
        "",
        "The seventh column is the time the 8 rows' multiply-accumulates of every matrix take at "
        "the rate MatMulInteger reaches here at 8 rows with its weights streamed from memory "
        "(the table below); a 1-row step already pays for reading the weights once. The "
        "attention floor is each row's fp32 cache read once at the read bandwidth measured in "
        "this run. Ceilings of 8 streams / 1:",
        "",
        "| bundle | with the steps as measured | attention at its floor | every matrix at the "
        "int8 peak | both: what the hardware allows |",
        "|---|---:|---:|---:|---:|",
    ]
    keys = (
        "ratio_ceiling",
        "ratio_ceiling_attention_floor",
        "ratio_ceiling_at_peak",
        "ratio_ceiling_hardware",
    )
    lines += [f"| {q} | {_cells(x, keys)} |" for q, x in c.items()]
    lines += [
        "",
        "Under 3 with the steps as measured, no scheduling meets the target: the 8-row step itself "
        "must get cheaper. Under 3 with attention at its floor, MatMulNBits alone (as ONNX Runtime "
        "runs it, prefill included) rules the target out whatever the attention kernel. At the "
        "peak, every matrix of the prefill and of both steps runs at the fastest int8 GEMM rate "
        "measured here (compute-bound: the machine's practical int8 peak), a step never faster "
        "than reading its weights once. Over 3 there, the limit is the kernels, not the machine.",
        "",
    ]
    return lines


def gemm_paragraph(r: dict) -> str:
    """The plain int8 GEMM against MatMulNBits, each sentence following the measured rates."""
    peak = {int(m): v for m, v in r["int8_gemm_gmac_s"].items()}
    rates = [list(rows.values()) for rows in r["matmul_nbits"].values()]
    best_8 = max(rows[1]["gmac_s"] for rows in rates)
    best_many = max(rows[-1]["gmac_s"] for rows in rates)
    text = (
        "ONNX Runtime's plain int8 GEMM (MatMulInteger, u8 × s8) on the same MLP matrices of "
        "every layer (weights streamed from memory) in the same run: "
        + ", ".join(f"{v:.0f} GMAC/s at {m} rows" for m, v in peak.items())
        + f". At 128 rows MatMulNBits reaches at best {best_many / peak[128]:.0%} of it"
    )
    held = best_many < 0.8 * peak[128]
    text += ": a prefill is held by the kernel, not by the machine. " if held else ". "
    if peak[8] <= 1.1 * best_8:
        text += (
            f"At 8 rows the plain GEMM ({peak[8]:.0f} GMAC/s) is no faster than the best "
            f"MatMulNBits row ({best_8:.0f}): ONNX Runtime has no operator that does a batched "
            "decode step's matrix work faster. "
        )
    else:
        text += (
            f"At 8 rows the plain GEMM ({peak[8]:.0f} GMAC/s) is {peak[8] / best_8:.1f}× the best "
            f"MatMulNBits row ({best_8:.0f}): on this CPU a batched step's matrices could run "
            "faster through it. "
        )
    return text + (
        "MatMulInteger takes one activation zero point for the whole batch and one weight scale "
        "per output column, not per block: a graph using it must quantize each row with its own "
        "scale around the operator (or a row's tokens would depend on the other rows in its "
        "step), and its weights lose the block scales."
    )


def markdown(r: dict) -> str:
    lines = [
        f"# Where a served token's time goes, bangla-0.4b (random weights), {r['date']}",
        "",
        f"CPU: {cpu_name(r['cpu'])}; {r['threads']} threads; "
        f"decode steps {r['prompt']} tokens into each row's sequence. Made by "
        "`benchmarks/serve/profile_serve.py` (ONNX Runtime's profiler).",
        "",
        f"Machine load: {r.get('machine_load', 'not noted')}.",
        "",
        "## Decode step and prefill, milliseconds by operator",
        "",
    ]
    cols = []
    for q, b in r["bundles"].items():
        for rows, d in b["decode"].items():
            cols.append((f"{q} decode {rows} row{'s' if int(rows) > 1 else ''}", d))
        cols.append((f"{q} prefill {b['prefill']['tokens']}", b["prefill"]))
    ops = sorted(
        {op for _, d in cols for op in d["ops_ms"]}, key=lambda op: -cols[0][1]["ops_ms"].get(op, 0)
    )
    lines += ["| operator | " + " | ".join(c for c, _ in cols) + " |"]
    lines += ["|---|" + "---:|" * len(cols)]
    for op in ops:
        lines.append(
            f"| {op} | " + " | ".join(f"{d['ops_ms'].get(op, 0):.2f}" for _, d in cols) + " |"
        )
    lines.append(
        "| **ONNX Runtime run** | " + " | ".join(f"{d['run_ms']:.2f}" for _, d in cols) + " |"
    )
    walls = [f"{d['wall_ms']:.2f}" if "wall_ms" in d else "–" for _, d in cols]
    lines.append("| **wall, unprofiled** | " + " | ".join(walls) + " |")
    outside = [f"{d['outside_ort_ms']:.2f}" if "outside_ort_ms" in d else "–" for _, d in cols]
    lines.append("| of which outside ONNX Runtime (Python) | " + " | ".join(outside) + " |")
    cpus = [f"{d['cpu_ms']:.2f}" if "cpu_ms" in d else "–" for _, d in cols]
    lines.append("| CPU time of the process, unprofiled | " + " | ".join(cpus) + " |")
    lines += ["", *reading(r)]
    if "ceiling" in r:
        lines += ["", *ceiling_lines(r["ceiling"])]
    lines += [
        "",
        "Foreign CPU during the decode profiles: "
        + ", ".join(f"{q} {b['foreign_cpu_s']:.0f} s" for q, b in r["bundles"].items())
        + f" (whole run {r['wall_s']:.0f} s).",
        "",
        "## Sampling one row of logits, milliseconds",
        "",
        "| sampling | ms |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:.3f} |" for k, v in r["sampling_ms"].items()]
    lines += [
        "",
        "## MatMulNBits alone: the MLP's matrices (gate, up, down), all layers, by block size",
        "",
        "Accuracy level 4; milliseconds for 1 / 8 / 128 rows, and rows served in the time of "
        "one (what batching can gain in this operator).",
        "",
        "| weights | 1 row ms | 8 rows ms | × | 128 rows ms | × | GMAC/s at 8 / 128 rows |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in r["matmul_nbits"].items():
        one, eight, many = rows.values()  # 1, 8 and 128 rows
        lines.append(
            f"| {name} | {one['ms']:.2f} | {eight['ms']:.2f} | "
            f"{eight['rows_per_one_row_time']:.2f} | {many['ms']:.1f} | "
            f"{many['rows_per_one_row_time']:.1f} | "
            f"{eight.get('gmac_s', 0):.0f} / {many.get('gmac_s', 0):.0f} |"
        )
    if "int8_gemm_gmac_s" in r:
        lines += ["", gemm_paragraph(r)]
    lines += [
        "",
        f"Foreign CPU during the MatMulNBits rows: {r['matmul_foreign_cpu_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, work=SERVE_WORK_HELP)
    ap.add_argument("--render", help="a result JSON to write as Markdown again (no measuring)")
    args = ap.parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    work = Path(args.work or tempfile.mkdtemp(prefix="profile_serve_"))
    result = run(work)
    result["machine_load"] = load_line("at the end (2 cores)")
    name = f"profile_serve_0.4b_cpu-{result['cpu']['class']}"
    publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
