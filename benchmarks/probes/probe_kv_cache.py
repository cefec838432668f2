"""GroupQueryAttention alone with each KV cache type ONNX Runtime's CPU kernel takes (issue 57).

The int8-KV-cache lever: ONNX Runtime 1.32's GroupQueryAttention reads an int8 cache
(`kv_cache_bit_width` 8, `k_quant_type` / `v_quant_type` PER_TENSOR or PER_CHANNEL, fp32
`k_scale` / `v_scale` after five empty optional inputs), a quarter of the fp32 cache's bytes. Does
it make a decode step's attention faster on the CPU? One GroupQueryAttention node a graph, as a
decode step meets it: one query row, the cache bound in place as past and present (the engine's
shared buffer, BUFFER positions), the new entry written after CACHES positions; for each model's
heads (SmolLM2-135M: 9/3, the 0.4B preset: its config's), each cache type:
- fp32: the cache doel exports;
- fp16 cache, fp32 query: the cache type apart from the query's (1.32 takes it);
- fp16: query and cache in fp16, export/kvcache.py's graph (its two Casts a layer not timed);
- int8 per tensor / per channel: one scale for the cache, or one a (KV head, channel).
Microseconds a call (best of ROUNDS rounds of CALLS calls, the types interleaved in each round),
times the layers: milliseconds a token. Each setting of ORT_GQA_DISABLE_FLASH_ATTENTION (0, the
default, and 1) in its own process. Beside it each type's attention output against fp32 on the
same cache (random keys and values of a spread of channel scales, rounded to the type): the
largest difference over the largest output.

`flock /tmp/doel-bench.lock python -m benchmarks.probes.probe_kv_cache`; writes
benchmarks/results/kv_cache_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common.report import (
    command,
    heading,
    load_line,
    parser,
    publish,
    render_again,
    stamp,
)
from benchmarks.export.bench_export import foreign_cpu

RESULTS = ("kv_cache_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]
THREADS = 2
CACHES = (128, 512, 1536)
BUFFER = 2048  # positions a slot's cache holds (the 0.4B's context; the engine binds it whole)
CALLS, ROUNDS = 200, 15
# SmolLM2-135M-Instruct's config.json (imported by benchmarks/export/bench_real_model.py)
SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30}
TYPES = ("fp32", "fp16 cache, fp32 query", "fp16", "int8 per tensor", "int8 per channel")


def shapes() -> dict[str, dict]:
    """{model: heads, kv_heads, head_dim, layers}: SmolLM2-135M's and the 0.4B preset's."""
    from doel.train.config import load_config
    from doel.train.settings import TrainConfig

    m = load_config(TrainConfig, ROOT / "configs" / "bangla-0.4b.toml").model
    hd = getattr(m, "head_dim", None) or m.hidden_size // m.num_attention_heads
    big = {"heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads, "head_dim": hd}
    return {"smollm2-135m": SMOLLM2, "0.4b": big | {"layers": m.num_hidden_layers}}


def graph(kind: str, s: dict, buffer: int = BUFFER) -> bytes:
    """One GroupQueryAttention of cache type `kind` (TYPES) and shape `s`."""
    from onnx import TensorProto as T
    from onnx import helper

    h, kv, d = s["heads"], s["kv_heads"], s["head_dim"]
    q_t = T.FLOAT16 if kind == "fp16" else T.FLOAT
    c_t = {"fp32": T.FLOAT, "int8 per tensor": T.INT8, "int8 per channel": T.INT8}.get(
        kind, T.FLOAT16
    )
    quant = kind.startswith("int8")
    attrs = {"num_heads": h, "kv_num_heads": kv}
    ins = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"]
    if quant:
        qt = "PER_TENSOR" if "tensor" in kind else "PER_CHANNEL"
        attrs |= {"kv_cache_bit_width": 8, "k_quant_type": qt, "v_quant_type": qt}
        ins += ["", "", "", "", "", "k_scale", "v_scale"]
    node = helper.make_node(
        "GroupQueryAttention", ins, ["out", "present_k", "present_v"], domain="com.microsoft",
        **attrs,
    )  # fmt: skip
    vi = [
        helper.make_tensor_value_info("q", q_t, [1, 1, h * d]),
        helper.make_tensor_value_info("k", q_t, [1, 1, kv * d]),
        helper.make_tensor_value_info("v", q_t, [1, 1, kv * d]),
        helper.make_tensor_value_info("past_k", c_t, [1, kv, buffer, d]),
        helper.make_tensor_value_info("past_v", c_t, [1, kv, buffer, d]),
        helper.make_tensor_value_info("seqlens_k", T.INT32, [1]),
        helper.make_tensor_value_info("total", T.INT32, [1]),
    ]
    if quant:
        shape = [1] if "tensor" in kind else [kv, 1, d]
        vi += [helper.make_tensor_value_info(n, T.FLOAT, shape) for n in ("k_scale", "v_scale")]
    outs = [
        helper.make_tensor_value_info("out", q_t, [1, 1, h * d]),
        helper.make_tensor_value_info("present_k", c_t, [1, kv, buffer, d]),
        helper.make_tensor_value_info("present_v", c_t, [1, kv, buffer, d]),
    ]
    g = helper.make_graph([node], "gqa", vi, outs)
    opset = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(g, opset_imports=opset).SerializeToString()


def cache_values(s: dict, buffer: int = BUFFER, seed: int = 0) -> dict:
    """fp32 keys and values [1, kv, buffer, d] whose channels differ in scale (lognormal, as real
    keys have outlier channels), and the new row's q, k, v."""
    rng = np.random.default_rng(seed)
    kv, d, h = s["kv_heads"], s["head_dim"], s["heads"]
    spread = np.exp(rng.normal(0, 0.7, (1, kv, 1, d))).astype(np.float32)
    out = {n: rng.standard_normal((1, kv, buffer, d)).astype(np.float32) * spread
           for n in ("k", "v")}  # fmt: skip
    out["q_new"] = rng.standard_normal((1, 1, h * d)).astype(np.float32)
    for n in ("k", "v"):  # the new entry as the cache's (a scale of the cache clips it so)
        row = rng.standard_normal((1, 1, kv * d)).astype(np.float32)
        out[f"{n}_new"] = row * spread.reshape(1, 1, kv * d)
    return out


def quantize(x: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of a cache [1, kv, S, d]: (int8 values, scale [1] or [kv, 1, d])."""
    amax = np.abs(x).max(axis=(0, 2), keepdims=True)[0] if per_channel else np.abs(x).max()
    scale = np.maximum(np.asarray(amax, np.float32) / 127.0, 1e-8).astype(np.float32)
    q = np.clip(np.rint(x / (scale[None] if per_channel else scale)), -127, 127).astype(np.int8)
    return q, scale.reshape(scale.shape if per_channel else (1,))


class Call:
    """One type's session and binding over its cache buffers (past and present the same)."""

    def __init__(self, kind: str, s: dict, values: dict, threads: int = THREADS):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        model = graph(kind, s, values["k"].shape[2])
        self.s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        q_dt = np.float16 if kind == "fp16" else np.float32
        feeds = {n: values[f"{n}_new"].astype(q_dt) for n in ("q", "k", "v")}
        if kind.startswith("int8"):
            per_channel = "channel" in kind
            for n in ("k", "v"):
                feeds[f"past_{n}"], feeds[f"{n}_scale"] = quantize(values[n], per_channel)
        else:
            dt = np.float32 if kind == "fp32" else np.float16
            feeds |= {f"past_{n}": np.ascontiguousarray(values[n].astype(dt)) for n in "kv"}
        self.feeds = feeds
        self.b = self.s.io_binding()
        for name, value in feeds.items():
            if not name.startswith("past_"):
                self.b.bind_cpu_input(name, value)
        for n in "kv":
            buf = ort.OrtValue.ortvalue_from_numpy(feeds[f"past_{n}"])
            self.b.bind_ortvalue_input(f"past_{n}", buf)
            self.b.bind_ortvalue_output(f"present_{n}", buf)
        self.out = ort.OrtValue.ortvalue_from_numpy(
            np.zeros((1, 1, s["heads"] * s["head_dim"]), q_dt)
        )
        self.b.bind_ortvalue_output("out", self.out)

    def at(self, cache: int) -> None:
        """The next calls attend to `cache` positions and the new one (written at `cache`)."""
        self.b.bind_cpu_input("seqlens_k", np.array([cache], np.int32))
        self.b.bind_cpu_input("total", np.array([cache + 1], np.int32))

    def run(self) -> np.ndarray:
        self.s.run_with_iobinding(self.b)
        return self.out.numpy().astype(np.float32)

    def us(self, calls: int = CALLS) -> float:
        self.s.run_with_iobinding(self.b)
        t0 = time.perf_counter()
        for _ in range(calls):
            self.s.run_with_iobinding(self.b)
        return (time.perf_counter() - t0) / calls * 1e6


def measure_model(s: dict, caches=CACHES, calls: int = CALLS, rounds: int = ROUNDS,
                  buffer: int = BUFFER) -> dict:  # fmt: skip
    """{type: {"us": {cache: us a call}, "error": {cache: largest difference / largest
    output}, "writes_only_its_entry": whether a call left the cache's other positions as they
    were} or {"error_text": why it did not run}}."""
    values = cache_values(s, buffer)
    made, out = {}, {}
    for kind in TYPES:
        try:
            made[kind] = Call(kind, s, values)
        except Exception as e:  # noqa: BLE001  a type this ONNX Runtime refuses: recorded
            out[kind] = {"error_text": str(e).splitlines()[0][:300]}
    for kind in made:
        out[kind] = {"us": {}, "error": {}, "writes_only_its_entry": True}
    for cache in caches:
        ref = None
        for kind, c in made.items():  # the outputs first: each call writes the same entry
            c.at(cache)
            before = c.feeds["past_k"].copy()
            y = c.run()
            ref = y if kind == "fp32" else ref
            out[kind]["error"][cache] = float(np.abs(y - ref).max() / np.abs(ref).max())
            moved = np.flatnonzero((c.feeds["past_k"] != before).any(axis=(0, 1, 3)))
            if set(moved.tolist()) - {cache}:  # an entry other than the new one changed
                out[kind]["writes_only_its_entry"] = False
        best = dict.fromkeys(made, float("inf"))
        for _ in range(rounds):
            for kind, c in made.items():
                best[kind] = min(best[kind], c.us(calls))
        for kind in made:
            out[kind]["us"][cache] = best[kind]
    return out


def child(plan: str) -> None:
    """In a process with ORT_GQA_DISABLE_FLASH_ATTENTION set by the parent: every model's
    types, one JSON line; `plan`: JSON of the caches, calls and rounds."""
    caches, calls, rounds = json.loads(plan)
    out = {m: measure_model(s, caches, calls, rounds) for m, s in shapes().items()}
    print(json.dumps(out))


def run() -> dict:
    result = {**stamp(python=True), "threads": THREADS, "buffer": BUFFER}
    result |= {"caches": list(CACHES), "calls": CALLS, "rounds": ROUNDS, "shapes": shapes()}
    result["flash"] = {}
    for setting in ("0", "1"):
        env = os.environ | {"ORT_GQA_DISABLE_FLASH_ATTENTION": setting}
        cmd = command("probes.probe_kv_cache", "--child", json.dumps([CACHES, CALLS, ROUNDS]))

        def go(cmd=cmd, env=env):
            return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)

        proc, foreign = foreign_cpu(go)
        if proc.returncode:
            raise SystemExit(f"child failed:\n{proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        result["flash"][setting] = {"models": got, "foreign_cpu_s": foreign}
    result["machine_load"] = load_line("at the end (2 cores)")
    return result


def markdown(r: dict) -> str:
    lines = heading("GroupQueryAttention alone, by KV cache type (the int8-cache lever)", r)
    lines += [
        f"Machine load: {r['load_start']:.1f} at the start, {r['machine_load']}. Foreign CPU "
        "seconds (other processes) during each process: "
        + ", ".join(
            f"ORT_GQA_DISABLE_FLASH_ATTENTION={s} {f['foreign_cpu_s']:.0f}"
            for s, f in r["flash"].items()
        )
        + ".",
        "",
        f"One GroupQueryAttention node, one query row, {r['threads']} threads, the cache bound "
        f"in place ({r['buffer']} positions a buffer); microseconds a call, best of "
        f"{r['rounds']} rounds of {r['calls']} calls, the types interleaved. A token's "
        "milliseconds: a call times the model's layers. Error: the largest difference of the "
        "attention output from fp32's on the same cache, over fp32's largest output.",
        "",
    ]
    for setting, f in r["flash"].items():
        default = " (the default)" if setting == "0" else ""
        lines += [f"## ORT_GQA_DISABLE_FLASH_ATTENTION={setting}{default}", ""]
        for model, types in f["models"].items():
            s = r["shapes"][model]
            head = (
                f"### {model}: heads {s['heads']}/{s['kv_heads']}, head {s['head_dim']}, "
                f"{s['layers']} layers"
            )
            lines += [head, ""]
            caches = [str(c) for c in r["caches"]]
            lines.append(
                "| cache type | "
                + " | ".join(f"us a call at {c} | × fp32 | ms a token" for c in caches)
                + f" | error at {caches[-1]} | other entries of the cache kept |"
            )
            lines.append("|---|" + "---:|---:|---:|" * len(caches) + "---:|---|")
            fp32 = types.get("fp32", {}).get("us", {})
            for kind, t in types.items():
                if "error_text" in t:
                    lines.append(f"| {kind} | not run: {t['error_text']} |")
                    continue
                cells = []
                for c in caches:
                    us = t["us"][c]
                    ratio = us / fp32[c] if c in fp32 else float("nan")
                    cells.append(f"{us:.1f} | {ratio:.2f} | {us * s['layers'] / 1000:.2f}")
                kept = "yes" if t.get("writes_only_its_entry", True) else "**no**"
                err = t["error"][caches[-1]]
                lines.append(f"| {kind} | " + " | ".join(cells) + f" | {err:.1e} | {kept} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--render", help="a result JSON to write as Markdown again (no measuring)")
    args = ap.parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return
    result = run()
    publish(args.out, f"kv_cache_cpu-{result['cpu']['class']}", result, markdown(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main()
