"""Where a decode token's time goes, unprofiled: the graph with its parts taken out (issue 57).

ONNX Runtime's profiler (profile_serve.py) times every node, and its own cost per node is of
the order of the small nodes it times; this probe asks the question without it. Copies of a
bundle's exported decode graph (model.onnx, the weights shared through model.onnx.data) where
one part is replaced by a pass-through of the right shape:
- GroupQueryAttention: the query's columns of the fused QKV projection (a Slice), no cache
  read or written (the cache inputs and outputs leave the graph);
- the norms: SkipSimplifiedLayerNormalization becomes the Add it does first (the residual sum
  kept), SimplifiedLayerNormalization its input;
- the activation: SiLU's Sigmoid and Mul leave; the gate's output goes to the up multiply;
- the head: the 8-bit MatMulNBits to the vocabulary becomes a zero Pad of the hidden state to the
  vocabulary's width (the logits still written);
- all four at once: what remains is the matrices, the embedding row and the graph's plumbing.
Each copy is timed over one-token decode steps after a cache of 128 and of 1,536 positions
(bench_serve's prompts), through the engine's own binding (the cache bound in place as input
and output, one logits row), the copies interleaved, best of ROUNDS. A part's cost is the full
step minus the step without it.

Beside it, in the same run: probe_chain.py's per-shape MatMulNBits (GB/s of each matrix of the
graph, their sum a step), an A/B of ONNX Runtime's `ORT_GQA_DISABLE_FLASH_ATTENTION` (0 / 1, each
in its own process, the engine's prefill of 128 and 1,536 tokens and its decode steps), and the
streaming-read bandwidth (probe_stream.py) with the numpy sum it replaced.

`--model 0.4b` (the preset's random weights) or `smollm2-135m` (the imported SmolLM2-135M,
real weights): bundles made by bench_serve.setup in `--work` (kept and reused). Writes
benchmarks/results/ablation_<model>_cpu-<class>.{json,md}; run under the benchmark lock:
`flock /tmp/doel-bench.lock python -m benchmarks.probes.probe_ablation --model 0.4b --work DIR`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.report import command, load_line, parser, publish, render_again, stamp
from benchmarks.export.bench_export import foreign_cpu
from benchmarks.probes import probe_chain
from benchmarks.probes.probe_ablation_report import markdown
from benchmarks.probes.probe_stream import bandwidth
from benchmarks.serve.bench_serve import MODELS, THREADS, setup

RESULTS = ("ablation_0.4b_cpu-<class>", "ablation_smollm2-135m_cpu-<class>")

ROOT = Path(__file__).resolve().parents[2]
CONTEXTS = (128, 1536)
STEPS, ROUNDS = 32, 3
PREFILLS = (128, 1536)
FLASH_PROCESSES = 2  # per setting, interleaved: 0, 1, 0, 1
PARTS = ("gqa", "norms", "activation", "head")
VARIANTS = {"full": (), **{f"no {p}": (p,) for p in PARTS}, "none of the four": PARTS}


def ablated(model: Path, drop: tuple[str, ...], q_width: int):
    """The graph of `model` with the parts in `drop` replaced (module docstring); its weights
    stay in the external data file beside it."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(model), load_external_data=False)
    g, nodes, rename, extra = m.graph, [], {}, []
    vocab = next(o for o in g.output if o.name == "logits").type.tensor_type.shape.dim[2].dim_value
    sigmoid = {n.output[0] for n in g.node if n.op_type == "Sigmoid"}
    silu = {  # x * sigmoid(x): the Mul's output -> x
        n.output[0]: next(x for x in n.input if x not in sigmoid)
        for n in g.node
        if n.op_type == "Mul" and sigmoid & set(n.input)
    }
    for n in g.node:
        if "gqa" in drop and n.op_type == "GroupQueryAttention":
            extra += [numpy_helper.from_array(np.array(v, np.int64), f"{n.name}/{k}") for k, v in
                      (("lo", [0]), ("hi", [q_width]), ("axis", [-1]))]  # fmt: skip
            ins = [n.input[0], *(f"{n.name}/{k}" for k in ("lo", "hi", "axis"))]
            nodes.append(helper.make_node("Slice", ins, [n.output[0]], name=n.name))
        elif "norms" in drop and n.op_type == "SkipSimplifiedLayerNormalization":
            out = n.output[3] if len(n.output) > 3 and n.output[3] else n.output[0]
            nodes.append(helper.make_node("Add", list(n.input[:2]), [out], name=n.name))
            if out != n.output[0]:
                rename[n.output[0]] = out
        elif "norms" in drop and n.op_type == "SimplifiedLayerNormalization":
            rename[n.output[0]] = n.input[0]
        elif "activation" in drop and n.op_type == "Sigmoid":
            continue
        elif "activation" in drop and n.output[0] in silu:
            rename[n.output[0]] = silu[n.output[0]]
        elif "head" in drop and n.op_type == "MatMulNBits" and "lm_head" in n.input[1]:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            pads = np.array([0, 0, 0, 0, 0, vocab - attrs["K"]], np.int64)
            extra.append(numpy_helper.from_array(pads, "head/pads"))
            nodes.append(helper.make_node("Pad", [n.input[0], "head/pads"], n.output, name=n.name))
        else:
            nodes.append(n)
    for n in nodes:
        for i, x in enumerate(n.input):
            while x in rename:
                x = rename[x]
            n.input[i] = x
    used = {x for n in nodes for x in n.input}
    del g.node[:]
    g.node.extend(nodes)
    inits = [t for t in g.initializer if t.name in used] + extra
    del g.initializer[:]
    g.initializer.extend(inits)
    kept_in = [i for i in g.input if i.name in used]
    del g.input[:]
    g.input.extend(kept_in)
    made = {x for n in nodes for x in n.output}
    kept_out = [o for o in g.output if o.name in made]
    del g.output[:]
    g.output.extend(kept_out)
    return m


class Stepper:
    """One-token decode steps of a graph through the engine's binding: the cache bound in place
    (input and output on the same buffers), one row of logits; `kv` shared between graphs."""

    def __init__(self, model: Path, kv: dict, vocab: int):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = THREADS
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        self.s = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        names = {i.name for i in self.s.get_inputs()}
        outs = {o.name for o in self.s.get_outputs()}
        self.b = self.s.io_binding()
        self.logits = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, vocab), np.float32))
        self.b.bind_ortvalue_output("logits", self.logits)
        for past, buf in kv.items():
            if past in names:
                self.b.bind_ortvalue_input(past, buf)
            present = past.replace("past_key_values.", "present.", 1)
            if present in outs:
                self.b.bind_ortvalue_output(present, buf)
        if "logits_to_keep" in names:
            self.b.bind_cpu_input("logits_to_keep", np.array(1, np.int64))
        self.b.bind_cpu_input("input_ids", np.array([[17]], np.int64))

    def ms(self, total: int, steps: int = STEPS) -> float:
        """Milliseconds a step at `total` positions (the mask made each step, as the engine)."""
        self.b.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
        self.s.run_with_iobinding(self.b)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.b.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
            self.s.run_with_iobinding(self.b)
        return (time.perf_counter() - t0) / steps * 1000


def kv_buffers(bundle: Path) -> dict:
    """Zeroed cache buffers of one slot, one a past input (the values do not change the time)."""
    import onnxruntime as ort

    from doel.serve.core.engine import read_bundle

    b = read_bundle(bundle)
    shape = (1, b.kv_heads, b.context_length, b.head_dim)
    dtype = np.float16 if b.manifest["kv_cache"].get("dtype") == "float16" else np.float32
    names = [f"past_key_values.{i}.{kv}" for kv in ("key", "value") for i in range(b.layers)]
    return {n: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype)) for n in names}


def ablation(bundle: Path) -> dict:
    """{context: {variant: ms a step}}, best of ROUNDS, the variants interleaved."""
    cfg = json.loads((bundle / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv, steppers, nodes = kv_buffers(bundle), {}, {}
    for name, drop in VARIANTS.items():
        path = bundle / f"ablate-{name.replace(' ', '-')}.onnx"
        m = ablated(bundle / "model.onnx", drop, cfg["num_attention_heads"] * hd)
        nodes[name] = len(m.graph.node)
        import onnx

        onnx.save(m, str(path))
        steppers[name] = Stepper(path, kv, cfg["vocab_size"])
    out = {}
    for ctx in CONTEXTS:
        best = {name: float("inf") for name in VARIANTS}
        for _ in range(ROUNDS):
            for name, st in steppers.items():
                best[name] = min(best[name], st.ms(ctx + 1))
        out[ctx] = best
    return {"ms": out, "nodes": nodes}


def flash_child(bundle: str, plan: str) -> None:
    """In a process with ORT_GQA_DISABLE_FLASH_ATTENTION set by the parent: the engine's
    prefill (best of 2) and decode steps (best of ROUNDS), printed as one JSON line; `plan`:
    JSON of the prefill lengths, cache lengths, steps and rounds."""
    prefills, contexts, steps, rounds = json.loads(plan)
    from doel.serve.core.engine import Engine, read_bundle

    e = Engine(read_bundle(bundle), threads=THREADS)
    e.warm_up()
    ids = np.random.default_rng(0).integers(16, 1000, max(prefills)).tolist()
    out = {"prefill_ms": {}, "decode_ms": {}}
    for n in prefills:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            e.forward(ids[:n], 0)
            times.append((time.perf_counter() - t0) * 1000)
        out["prefill_ms"][n] = min(times)
    for ctx in contexts:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                e.decode([17], [ctx + 1])
            best = min(best, (time.perf_counter() - t0) / steps * 1000)
        out["decode_ms"][ctx] = best
    print(json.dumps(out))


def flash_ab(bundle: Path) -> dict:
    """{"0": figures, "1": figures}: each setting's best over FLASH_PROCESSES processes."""
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for _ in range(FLASH_PROCESSES):
        for setting in runs:
            env = os.environ | {"ORT_GQA_DISABLE_FLASH_ATTENTION": setting}
            plan = json.dumps([PREFILLS, CONTEXTS, STEPS, ROUNDS])
            cmd = command("probes.probe_ablation", "--flash-child", bundle, plan)
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"flash A/B child failed:\n{proc.stderr[-2000:]}")
            runs[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {
        s: {k: {n: min(r[k][n] for r in rs) for n in rs[0][k]} for k in rs[0]}
        for s, rs in runs.items()
    }


def run(work: Path, model: str) -> dict:
    p = MODELS[model]
    setup(work, p, with_llama=False)
    result = {**stamp(python=True), "model": model, "weights": p["weights"], "threads": THREADS}
    result |= {"contexts": list(CONTEXTS), "steps": STEPS, "rounds": ROUNDS}
    result["bandwidth"] = bandwidth(THREADS)
    cfg = json.loads((work / "bundle-int4" / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    result["config"] = {k: cfg[k] for k in keys + ("num_attention_heads", "num_key_value_heads")}
    result["bundles"] = {}
    for q in ("int4", "int8"):
        b = work / f"bundle-{q}"
        print(f"ablation {q} ...", flush=True)
        abl, foreign = foreign_cpu(ablation, b)
        print(f"chain {q} ...", flush=True)
        chain = probe_chain.chain(b / "model.onnx", cfg["num_hidden_layers"])
        print(f"flash attention A/B {q} ...", flush=True)
        flash, foreign_ab = foreign_cpu(flash_ab, b)
        result["bundles"][q] = abl | {"chain": chain, "flash": flash}
        result["bundles"][q] |= {"foreign_cpu_s": foreign, "flash_foreign_cpu_s": foreign_ab}
    result["bandwidth_end"] = bandwidth(THREADS)
    result["machine_load"] = load_line("at the end (2 cores)")
    return result


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["--flash-child"]:
        flash_child(sys.argv[2], sys.argv[3])
        return
    ap = parser(__doc__, work="bench_serve.py's scratch folder for --model (kept and reused)")
    ap.add_argument("--model", choices=sorted(MODELS), default="0.4b")
    ap.add_argument("--render", help="a result JSON to write as Markdown again (no measuring)")
    args = ap.parse_args(argv)
    if args.render:
        render_again(args.render, markdown)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="probe_ablation_"))
    result = run(work, args.model)
    name = f"ablation_{args.model}_cpu-{result['cpu']['class']}"
    publish(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()
