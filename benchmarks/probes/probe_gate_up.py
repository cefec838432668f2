"""gate|up as one MatMulNBits: a lever for the fixed time of a decode token, measured (issue 57).

Each layer of a doel graph multiplies the MLP's input twice, by the gate and by the up matrix:
two MatMulNBits of the same input, K, bits, block and accuracy level, each quantizing the one
activation row to int8 and dispatching its own threads. The lever: one MatMulNBits of 2N rows
(B, [N, K / block, bytes], the scales, and zero points and bias where present, concatenated
along N: its first N outputs are the gate's, the next N the up's) and a Split of its output
into the two tensors the SiLU-multiply reads, under their old names. The bytes streamed are
the same; what changes is one call, one quantization of the row and one Split a layer.

The rewrite is the export's own (export/gate_up.py, on by default since this probe's first
result); a bundle exported before it, or with DOEL_EXPORT_GATE_UP=0, is what it compares against.
For each bundle given (int4, int8): the fused copy written beside a copy of the bundle's side
files (work folder), both loaded by the engine (serve/core/engine.py) with THREADS threads, and
- their logits compared: a prompt's every position, then greedy steps (the fused graph's
  largest difference from the original's, and whether the greedy ids agree);
- one-token decode steps (Engine.forward of one id after a cache of CONTEXTS positions) and a
  prefill of PREFILL ids, the two engines interleaved, best of ROUNDS rounds;
- the nodes of each graph as exported and as ONNX Runtime runs it (ORT_ENABLE_ALL), and
  whether ONNX Runtime's CPU provider runs com.microsoft's SwiGLU (which would take the Sigmoid,
  the Mul and the Mul of the activation into one node).

`python -m benchmarks.probes.probe_gate_up --model smollm2-135m --bundles INT4 INT8 --work DIR`
under the benchmark lock; writes benchmarks/results/gate_up_<model>_cpu-<class>.{json,md}.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.common.report import heading, load_line, parser, publish, render_again, stamp
from benchmarks.export.bench_export import foreign_cpu
from doel.export.gate_up import fuse_gate_up, node_attrs

RESULTS = ("gate_up_0.4b_cpu-<class>", "gate_up_smollm2-135m_cpu-<class>")

THREADS = 2
CONTEXTS = (128, 1536)
PREFILL = 128
STEPS, ROUNDS = 48, 7
PROMPT, GREEDY = 64, 16
MODELS = {
    "0.4b": "the 0.4B preset (bangla-0.4b), random weights",
    "smollm2-135m": "SmolLM2-135M-Instruct, imported weights",
}


def fused_bundle(bundle: Path, out: Path) -> dict:
    """A copy of `bundle` in `out` whose model.onnx has gate|up fused (its weights rewritten
    into out/model.onnx.data, every other file copied); {"layers": fused, "nodes": ...}."""
    import onnx

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in bundle.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy2(f, out / f.name)
    from doel.export.web_graph import load_weights

    m = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    load_weights(m, bundle)  # as onnx.load, but whatever the weights file's link count
    before = len(m.graph.node)
    layers = fuse_gate_up(m)
    onnx.save_model(
        m,
        str(out / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
    )
    return {"layers": layers, "nodes_before": before, "nodes_after": len(m.graph.node)}


def optimized_ops(model: Path) -> dict:
    """{"nodes": count, "ops": {op: count}} of the graph ONNX Runtime runs (ORT_ENABLE_ALL)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        opts.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "opt.data"
        )
        opts.log_severity_level = 3
        ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        m = onnx.load(str(Path(tmp) / "opt.onnx"), load_external_data=False)
    ops = Counter(n.op_type for n in m.graph.node)
    return {"nodes": len(m.graph.node), "ops": dict(ops.most_common())}


def swiglu_on_cpu() -> bool:
    """Whether ONNX Runtime's CPU provider has a kernel for com.microsoft's SwiGLU."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    vi = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4]) for x in "aby"]
    node = helper.make_node("SwiGLU", ["a", "b"], ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "swiglu", vi[:2], vi[2:])
    opset = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    m = helper.make_model(graph, opset_imports=opset)
    try:
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  NOT_IMPLEMENTED, or no such schema in an older release
        return False
    return True


def engines(bundle: Path, fused: Path, threads: int = THREADS):
    from doel.serve.core.engine import Engine, read_bundle

    out = {}
    for name, folder in (("original", bundle), ("fused", fused)):
        e = Engine(read_bundle(folder), threads=threads)
        e.warm_up()
        out[name] = e
    return out


def compare(es: dict, vocab: int, prompt: int = PROMPT, greedy: int = GREEDY) -> dict:
    """The fused engine's logits against the original's: every position of a prompt of random
    ids, then `greedy` steps each engine takes on its own argmax."""
    ids = np.random.default_rng(0).integers(16, vocab, prompt).tolist()
    full = {k: e.forward(ids, 0, every=True) for k, e in es.items()}
    diff = float(np.abs(full["original"] - full["fused"]).max())
    seqs, steps = {}, []
    for k, e in es.items():
        nxt, seq, logits = int(full[k][-1].argmax()), [], []
        for i in range(greedy):
            seq.append(nxt)
            row = e.forward([nxt], prompt + i)
            logits.append(row)
            nxt = int(row.argmax())
        seqs[k] = seq
        steps.append(np.stack(logits))
    step_diff = float(np.abs(steps[0] - steps[1]).max())
    return {
        "prompt_max_abs_diff": diff,
        "greedy_max_abs_diff": step_diff,
        "bit_identical": diff == 0.0 and step_diff == 0.0,
        "greedy_ids_equal": seqs["original"] == seqs["fused"],
        "greedy_ids": seqs["original"],
    }


def timings(
    es: dict, contexts=CONTEXTS, steps: int = STEPS, rounds: int = ROUNDS, prefill: int = PREFILL
) -> dict:
    """{"decode_ms": {ctx: {engine: ms}}, "prefill_ms": {engine: ms}}: best of `rounds`, the
    engines interleaved within each round."""
    ids = np.random.default_rng(1).integers(16, 1000, prefill).tolist()
    out: dict = {"decode_ms": {c: {k: float("inf") for k in es} for c in contexts}}
    out["prefill_ms"] = {k: float("inf") for k in es}
    for _ in range(rounds):
        for k, e in es.items():
            t0 = time.perf_counter()
            e.forward(ids, 0)
            out["prefill_ms"][k] = min(out["prefill_ms"][k], (time.perf_counter() - t0) * 1000)
        for c in contexts:
            for k, e in es.items():
                e.forward([17], c)
                t0 = time.perf_counter()
                for _ in range(steps):
                    e.forward([17], c)
                ms = (time.perf_counter() - t0) / steps * 1000
                out["decode_ms"][c][k] = min(out["decode_ms"][c][k], ms)
    return out


def describe(bundle: Path) -> dict:
    """The bundle's format: its manifest's bits and block, and its MatMulNBits by bits."""
    import onnx

    q = json.loads((bundle / "manifest.json").read_text())["quantization"]
    m = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    bits = Counter(int(node_attrs(n)["bits"]) for n in m.graph.node if n.op_type == "MatMulNBits")
    return {"bits": q.get("bits"), "block_size": q.get("block_size"), "matrices_by_bits": bits}


def measure(bundle: Path, work: Path) -> dict:
    cfg = json.loads((bundle / "config.json").read_text())
    fused_dir = work / f"{bundle.name}-gate-up"
    r = {"bundle": str(bundle), "format": describe(bundle)}
    r["fusion"] = fused_bundle(bundle, fused_dir)
    r["optimized"] = {
        "original": optimized_ops(bundle / "model.onnx"),
        "fused": optimized_ops(fused_dir / "model.onnx"),
    }
    es = engines(bundle, fused_dir)
    r["logits"] = compare(es, cfg["vocab_size"])
    t, foreign = foreign_cpu(timings, es)
    r |= t | {"foreign_cpu_s": foreign}
    del es
    shutil.rmtree(fused_dir)
    return r


def run(model: str, bundles: list[Path], work: Path) -> dict:
    result = {**stamp(python=True), "model": model, "weights": MODELS[model]}
    result |= {"threads": THREADS, "steps": STEPS, "rounds": ROUNDS, "prefill": PREFILL}
    result |= {"contexts": list(CONTEXTS), "swiglu_cpu_kernel": swiglu_on_cpu()}
    cfg = json.loads((bundles[0] / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    result["config"] = {k: cfg[k] for k in keys + ("num_key_value_heads", "vocab_size")}
    result["bundles"] = {}
    for b in bundles:
        label = f"int{describe(b)['bits']}"
        print(f"gate|up {label} ({b}) ...", flush=True)
        result["bundles"][label] = measure(b, work)
    result["machine_load"] = load_line("at the end (2 cores)")
    return result


def verdict(b: dict) -> str:
    """`faster` where the fused graph's decode is faster at every cache length, else `not`."""
    d = b["decode_ms"]
    return "faster" if all(v["fused"] < v["original"] for v in d.values()) else "not faster"


def markdown(r: dict) -> str:
    c = r["config"]
    lines = heading(f"gate|up as one MatMulNBits: {r['model']} ({r['weights']})", r)
    lines += [
        f"Model: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, heads {c['num_attention_heads']}/"
        f"{c['num_key_value_heads']}, vocabulary {c['vocab_size']}. {r['threads']} threads.",
        "",
        f"Machine load: {r['load_start']:.1f} at the start, {r['machine_load']}. Foreign CPU "
        "seconds (other processes) during each bundle's timing: "
        + ", ".join(f"{q} {b['foreign_cpu_s']:.0f}" for q, b in r["bundles"].items())
        + ".",
        "",
        "## Decode and prefill, original against fused",
        "",
        f"The engine (serve/core/engine.py) on each graph, one id after a cache of each length "
        f"({r['steps']} steps a round) and a prefill of {r['prefill']} ids, best of "
        f"{r['rounds']} rounds, the two engines interleaved in each round.",
        "",
        "| bundle | format | measure | original ms | fused ms | fused / original |",
        "|---|---|---|---:|---:|---:|",
    ]
    for q, b in r["bundles"].items():
        f = b["format"]
        mix = ", ".join(f"{n}× {k}-bit" for k, n in sorted(f["matrices_by_bits"].items()))
        fmt = f"block {f['block_size']}; {mix}"
        rows = [(f"decode after {ctx}", v) for ctx, v in b["decode_ms"].items()]
        rows.append((f"prefill {r['prefill']}", b["prefill_ms"]))
        for what, v in rows:
            lines.append(
                f"| {q} | {fmt} | {what} | {v['original']:.3f} | {v['fused']:.3f} | "
                f"{v['fused'] / v['original']:.3f} |"
            )
    lines += [
        "",
        "## The graphs",
        "",
        "| bundle | layers fused | nodes as exported (original / fused) | nodes ONNX Runtime runs "
        "(original / fused) | MatMulNBits run | Split run | logits: largest difference "
        "(prompt / greedy steps) | greedy ids equal |",
        "|---|---:|---|---|---|---|---|---|",
    ]
    for q, b in r["bundles"].items():
        o, fz = b["optimized"]["original"], b["optimized"]["fused"]
        lg = b["logits"]
        lines.append(
            f"| {q} | {b['fusion']['layers']} | {b['fusion']['nodes_before']} / "
            f"{b['fusion']['nodes_after']} | {o['nodes']} / {fz['nodes']} | "
            f"{o['ops'].get('MatMulNBits', 0)} / {fz['ops'].get('MatMulNBits', 0)} | "
            f"{o['ops'].get('Split', 0)} / {fz['ops'].get('Split', 0)} | "
            f"{lg['prompt_max_abs_diff']:.2e} / {lg['greedy_max_abs_diff']:.2e} | "
            f"{'yes' if lg['greedy_ids_equal'] else 'no'} |"
        )
    first = next(iter(r["bundles"].values()))["optimized"]["original"]["ops"]
    lines += [
        "",
        "What ONNX Runtime runs of the original graph: "
        + ", ".join(f"{n} {op}" for op, n in first.items())
        + f". com.microsoft's SwiGLU (the activation's Sigmoid, Mul and Mul as one node) has "
        f"{'a' if r['swiglu_cpu_kernel'] else 'no'} CPU kernel in this ONNX Runtime.",
        "",
        "Verdict: "
        + "; ".join(f"{q} fused decode {verdict(b)}" for q, b in r["bundles"].items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, work="scratch folder for the fused copies (removed after each)")
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--bundles", nargs="+", type=Path, required=True, help="int4 and int8")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="probe_gate_up_"))
    result = run(args.model, args.bundles, work)
    name = f"gate_up_{args.model}_cpu-{result['cpu']['class']}"
    publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:  # a result's JSON written as Markdown again
        render_again(sys.argv[2], markdown)
    else:
        main()
