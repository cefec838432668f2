"""Probe: one linear layer in onnxruntime-web's WebAssembly build (Node.js, one thread), three ways.

Why the --web page decodes the int4 0.4B model ~37x slower than doel-serve
(benchmarks/results/web_cpu-*.md): this times a [1, K] x [K, N] product (the 0.4B model's
gate/up projection, K 1024, N 2816) as fp32 MatMul, as int8 DynamicQuantizeMatMul (one scale a
column) and as int4 MatMulNBits (block 128, symmetric, what doel's int4 bundles hold), each after
warm-up, the mean of 40 runs. The runtime is the one `doel-export --web` installs (export/web.py).

Run: `python -m benchmarks.probe_web_matmul` (needs Node.js and npm); prints a Markdown table.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from doel.export.web import runtime_modules

K, N, RUNS = 1024, 2816, 40

TIMER = """
const ort = await import(process.argv[2]);
ort.env.wasm.numThreads = 1;
const fs = await import("node:fs");
const out = {};
for (const name of process.argv.slice(3)) {
  const opts = {executionProviders: ["wasm"]};
  const s = await ort.InferenceSession.create(fs.readFileSync(name), opts);
  const a = Float32Array.from({length: %K%}, (_, i) => Math.sin(i));
  const A = new ort.Tensor("float32", a, [1, %K%]);
  for (let i = 0; i < 3; i++) await s.run({A});
  const t = performance.now();
  for (let i = 0; i < %RUNS%; i++) await s.run({A});
  out[name] = (performance.now() - t) / %RUNS%;
}
console.log(JSON.stringify(out));
"""


def graph(nodes, inits, path: Path, contrib: bool = True) -> Path:
    g = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, N])],
        inits,
    )
    ops = [helper.make_opsetid("", 21)] + ([helper.make_opsetid("com.microsoft", 1)] * contrib)
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = 10  # what onnxruntime-web 1.30 reads
    onnx.save(m, str(path))
    return path


def models(work: Path) -> dict[str, Path]:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    fp32 = graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"])],
        [numpy_helper.from_array(w, "W")],
        work / "fp32.onnx",
        contrib=False,
    )
    scale = (np.abs(w).max(0) / 127).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    int8 = graph(
        [
            helper.make_node(
                "DynamicQuantizeMatMul", ["A", "B", "s", "z"], ["Y"], domain="com.microsoft"
            )
        ],
        [
            numpy_helper.from_array(q, "B"),
            numpy_helper.from_array(scale, "s"),
            numpy_helper.from_array(np.zeros(N, np.int8), "z"),
        ],
        work / "int8.onnx",
    )
    nbits = MatMulNBitsQuantizer(
        onnx.load(str(fp32)), bits=4, block_size=128, is_symmetric=True, accuracy_level=4
    )
    nbits.process()
    m = nbits.model.model
    m.ir_version = 10
    onnx.save(m, str(work / "int4.onnx"))
    return {
        "fp32 MatMul": fp32,
        "int8 DynamicQuantizeMatMul": int8,
        "int4 MatMulNBits (block 128)": work / "int4.onnx",
    }


def main() -> None:
    ort = runtime_modules() / "onnxruntime-web" / "dist" / "ort.node.min.mjs"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        paths = models(work)
        script = work / "time.mjs"
        script.write_text(TIMER.replace("%K%", str(K)).replace("%RUNS%", str(RUNS)))
        cmd = ["node", str(script), ort.as_uri(), *map(str, paths.values())]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        times = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"| [1, {K}] x [{K}, {N}], onnxruntime-web wasm, 1 thread | ms a run | vs fp32 |")
    print("|---|---:|---:|")
    base = times[str(paths["fp32 MatMul"])]
    for name, path in paths.items():
        t = times[str(path)]
        print(f"| {name} | {t:.3f} | {t / base:.1f}x |")


if __name__ == "__main__":
    main()
