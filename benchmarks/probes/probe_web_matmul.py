"""Probe: one linear layer of the 0.4B model, every way the browser page can hold it.

In Node.js and in headless Chromium, per WebAssembly build and thread count: the map of what the
page (`doel-export --web`) can run small and fast. Decided: the page's modes (export/web_graph.py
and doel's own kernel, export/web/kernel.c) are the fastest ways whose weights stay at 8 bits or
fewer (probe_web_table's verdict); the evidence is benchmarks/results/web_probe_cpu-<class>.md,
kept runnable and not run in CI.

Each graph computes Y = A W for A [rows, K] fp32 (rows 1: a decode step; PREFILL: a prefill
chunk, as the page's) and W the 0.4B model's gate/up ([1024, 2816]) or down ([2816, 1024])
projection, held as
- fp32 MatMul (what the page's default mode folds its weights to at load),
- fp16 weights with a Cast (ONNX Runtime folds the Cast at load: fp32 in memory again),
- MatMulInteger u8 x s8 and u8 x u8 behind DynamicQuantizeLinear, constant weights (prepacked),
- DynamicQuantizeMatMul (s8, one scale a column),
- QDQ: DequantizeLinear (int8 a column; int4 blocked along K) -> MatMul, with ONNX Runtime's QDQ
  rules on (they keep the weights quantized: constant folding skips DequantizeLinear; the int4
  pair is fused into MatMulNBits), and int8 with a static QuantizeLinear on A as well,
- MatMulNBits, 4 bits (block 256, doel's int4) and 8 bits (block 128, doel's int8 when it was
  measured), at accuracy levels 0/1/4 (4: int8 activations),
- and beside them, not in ONNX Runtime: doel's own WebAssembly kernel (export/web/kernel.c's
  dk_linear, the page's default WebAssembly mode) on MatMulNBits' 4-bit block-256 bytes as they
  are, its plain-SIMD and relaxed-SIMD builds; single-threaded, so at 1 thread only. A build
  whose dk_selftest fails (the engine computes relaxed SIMD's dot otherwise) is not timed.
Timings: ONNX Runtime's own session.run (or dk_linear, with A copied in and Y out as session.run
does) in a Web Worker (Chromium, the page's setting) or Node's
main thread, after two warm-up runs, the median of up to RUNS runs within BUDGET_MS. Beside each:
its relative error against the fp32 graph's output (a kernel that computes something else would
show) and the bytes its weights take in memory after ONNX Runtime's load-time rewrites.

Run (it times; hold the benchmark lock): `flock /tmp/doel-bench.lock python -m
benchmarks.probes.probe_web_matmul` (Node.js and npm; Chromium and chromedriver for its browser
rows).
Results: benchmarks/results/web_probe_cpu-<class>.{json,md} (benchmarks/probes/probe_web_table.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from benchmarks.common.report import parser, publish, stamp
from benchmarks.export.bench_export import machine_busy_s
from benchmarks.probes import probe_web_table
from benchmarks.web.bench_web import CHROMIUM, browser, settled, tree_cpu_s
from doel.export.web import runtime_modules, static_server
from doel.export.web_kernel import KERNEL, WASM

RESULTS = ("web_probe_cpu-<class>",)

SHAPES = {"gate/up": (1024, 2816), "down": (2816, 1024)}
PREFILL, RUNS, BUDGET_MS = 128, 30, 300
THREADS = (1, 2)
# Chromium's rows: each UMD build of the package with the wasm binary it loads (grep its
# `ort-wasm-simd-threaded*.mjs`); Node.js runs ort.node.min.mjs (the plain binary).
BUILDS = {
    "plain": "ort.wasm.min.js",  # ort-wasm-simd-threaded.wasm, what the page's wasm mode loads
    "jsep": "ort.min.js",  # ort-wasm-simd-threaded.jsep.wasm (the JS WebGPU/WebNN EPs' build)
    "webgpu": "ort.webgpu.min.js",  # ...asyncify.wasm (the native WebGPU EP's build)
}
KERNEL_BLOCK = 256  # the bundle's int4 block
KERNELS = {"simd": "plain SIMD", "relaxed": "relaxed SIMD"}  # export.web_kernel.WASM's keys
NBITS4 = f"MatMulNBits 4-bit block {KERNEL_BLOCK}, accuracy level 4"  # the kernel rows follow it

# One JS function for both hosts: `models` [{name, k, bytes}] (a kernel's also n, code, scales,
# block), returns {name: {ms: {rows: ms}, err<rows>}} or {name: {error}} / {name: {skipped}}.
CORE = """
async function timed(run, runs, budget) {
  let y;
  for (let i = 0; i < 2; i++) y = await run();
  const times = [];
  const t0 = performance.now();
  while (times.length < runs && (times.length < 3 || performance.now() - t0 < budget)) {
    const t = performance.now();
    await run();
    times.push(performance.now() - t);
  }
  times.sort((x, z) => x - z);
  return [times[times.length >> 1], y];
}

function input(rows, k) {
  return Float32Array.from({length: rows * k}, (_, i) => Math.sin(i * 0.37));
}

function relErr(y, ref) {
  let num = 0, den = 0;
  for (let i = 0; i < y.length; i++) {
    num += (y[i] - ref[i]) ** 2;
    den += ref[i] ** 2;
  }
  return Math.sqrt(num / den);
}

// doel's kernel: one instance a model, its weights copied in once; a run copies A in and Y out.
async function kernel(m, ref, rowsList, runs, budget) {
  let x;
  try {
    x = (await WebAssembly.instantiate(m.code, {})).instance.exports;
  } catch (err) {
    return {error: "does not compile in this host"};
  }
  if (!x.dk_selftest()) return {error: "wrong numbers in this host"};
  const top = Math.max(...rowsList);
  const w = x.dk_alloc(m.bytes.length);
  const a = x.dk_alloc(4 * top * m.k), y = x.dk_alloc(4 * top * m.n);
  // N = 0: nothing computed; its activation buffers are sized once, for the most rows
  x.dk_linear(y, a, top, m.k, 0, w, w + m.scales, m.block);
  new Uint8Array(x.memory.buffer, w, m.bytes.length).set(m.bytes);
  const r = {ms: {}};
  for (const rows of rowsList) {
    const A = input(rows, m.k);
    const run = () => {
      new Float32Array(x.memory.buffer, a, A.length).set(A);
      x.dk_linear(y, a, rows, m.k, m.n, w, w + m.scales, m.block);
      return new Float32Array(x.memory.buffer, y, rows * m.n).slice();
    };
    const [ms, Y] = await timed(run, runs, budget);
    r.ms[rows] = ms;
    r[`err${rows}`] = relErr(Y, ref[`${m.k}:${rows}`]);
  }
  return r;
}

async function probe(ort, models, rowsList, runs, budget, threads) {
  const out = {};
  let ref = {};
  for (const m of models) {
    if (m.code) {  // the kernel is single-threaded: its 1-thread row is the one
      out[m.name] = threads === 1 ? await kernel(m, ref, rowsList, runs, budget)
                                  : {skipped: "single-threaded"};
      continue;
    }
    const s = await ort.InferenceSession.create(m.bytes,
      {executionProviders: ["wasm"], graphOptimizationLevel: "all"});
    const r = {ms: {}};
    for (const rows of rowsList) {
      const A = new ort.Tensor("float32", input(rows, m.k), [rows, m.k]);
      const [ms, y] = await timed(async () => (await s.run({A})).Y.data, runs, budget);
      r.ms[rows] = ms;
      const key = `${m.k}:${rows}`;
      if (!(key in ref)) ref[key] = y;  // the first model of a shape is fp32
      r[`err${rows}`] = relErr(y, ref[key]);
    }
    await s.release();
    out[m.name] = r;
  }
  return out;
}
"""

NODE = (
    CORE
    + """
const ort = await import(process.argv[2]);
const fs = await import("node:fs");
// Node 20's V8 has relaxed SIMD behind a flag (later ones by default); it only lets modules use
// those opcodes (onnxruntime-web's binary has none) and an unknown flag is ignored
(await import("node:v8")).setFlagsFromString("--experimental-wasm-relaxed-simd");
const threads = Number(process.argv[3]);
ort.env.wasm.numThreads = threads;
const models = JSON.parse(fs.readFileSync(process.argv[4], "utf8")).map((m) => ({...m,
  bytes: fs.readFileSync(m.file), code: m.wasm && fs.readFileSync(m.wasm)}));
console.log(JSON.stringify(await probe(ort, models, %ROWS%, %RUNS%, %BUDGET%, threads)));
"""
)

WORKER = (
    CORE
    + """
self.onmessage = async (e) => {
  const {build, threads, list} = e.data;
  try {
    importScripts(build);
    ort.env.wasm.numThreads = threads;
    ort.env.wasm.wasmPaths = new URL("./", self.location.href).href;
    const models = [];
    const get = async (f) => new Uint8Array(await (await fetch(f)).arrayBuffer());
    for (const m of list)
      models.push({...m, bytes: await get(m.file), code: m.wasm && (await get(m.wasm))});
    const r = await probe(ort, models, %ROWS%, %RUNS%, %BUDGET%, threads);
    self.postMessage({result: r, isolated: self.crossOriginIsolated});
  } catch (err) {
    self.postMessage({error: String(err && err.message ? err.message : err)});
  }
};
"""
)

PAGE = """<!doctype html><meta charset="utf-8"><title>probe</title><script>
window.runProbe = (msg) => new Promise((resolve) => {
  const w = new Worker("probe-worker.js");
  w.onmessage = (e) => { w.terminate(); resolve(e.data); };
  w.onerror = (e) => { w.terminate(); resolve({error: e.message || "worker error"}); };
  w.postMessage(msg);
});
</script>"""


def save(nodes, inits, path: Path, k: int, n: int) -> Path:
    g = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", n])],
        inits,
    )
    ops = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = 10  # what onnxruntime-web 1.30 reads
    onnx.save(m, str(path))
    return path


def nbits_weight(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' B [N, blocks, block*bits/8] (zero point 2^(bits-1), symmetric) and scales."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // block, block)
    top = (1 << (bits - 1)) - 1
    scale = np.abs(blocks).max(-1) / top
    q = (np.clip(np.round(blocks / scale[..., None]), -top, top) + (1 << (bits - 1))).astype(
        np.uint8
    )
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale.astype(np.float32)


def per_column(w: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 weights a column: (integers, scales [N], zero points [N])."""
    scale = (np.abs(w).max(0) / 127).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127)
    if signed:
        return q.astype(np.int8), scale, np.zeros(w.shape[1], np.int8)
    return (q + 128).astype(np.uint8), scale, np.full(w.shape[1], 128, np.uint8)


def weight(k: int, n: int) -> np.ndarray:
    """The shape's weight [K, N], the same in every graph and the kernel's rows."""
    return (np.random.default_rng(k).standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)


def graphs(work: Path, k: int, n: int) -> dict[str, tuple[Path, float]]:
    """The graphs of one shape: name -> (file, bytes its weights take in memory at run time)."""
    w = weight(k, n)
    t = numpy_helper.from_array
    mk = helper.make_node
    out: dict[str, tuple[Path, float]] = {}

    def add(name, nodes, inits, mem_bytes):
        out[name] = (save(nodes, inits, work / f"{k}x{n}-{len(out)}.onnx", k, n), mem_bytes)

    add("fp32 MatMul", [mk("MatMul", ["A", "W"], ["Y"])], [t(w, "W")], 4 * k * n)
    add(
        "fp16 weights + Cast (folded to fp32)",
        [mk("Cast", ["W16"], ["W"], to=TensorProto.FLOAT), mk("MatMul", ["A", "W"], ["Y"])],
        [t(w.astype(np.float16), "W16")],
        4 * k * n,
    )
    for signed in (True, False):
        q, s, z = per_column(w, signed)
        name = f"MatMulInteger u8 x {'s8' if signed else 'u8'} (DynamicQuantizeLinear)"
        nodes = [
            mk("DynamicQuantizeLinear", ["A"], ["Aq", "As", "Az"]),
            mk("MatMulInteger", ["Aq", "Wq", "Az", "Wz"], ["I"]),
            mk("Cast", ["I"], ["F"], to=TensorProto.FLOAT),
            mk("Mul", ["As", "Ws"], ["S"]),
            mk("Mul", ["F", "S"], ["Y"]),
        ]
        add(name, nodes, [t(q, "Wq"), t(s, "Ws"), t(z, "Wz")], k * n)
    q, s, z = per_column(w, True)
    node = mk("DynamicQuantizeMatMul", ["A", "B", "s", "z"], ["Y"], domain="com.microsoft")
    add("DynamicQuantizeMatMul s8", [node], [t(q, "B"), t(s, "s"), t(z, "z")], k * n)
    dq = mk("DequantizeLinear", ["Wq", "Ws"], ["W"], axis=1)
    add(
        "QDQ int8 a column: DequantizeLinear -> MatMul",
        [dq, mk("MatMul", ["A", "W"], ["Y"])],
        [t(q, "Wq"), t(s, "Ws")],
        k * n,
    )
    a_scale = np.float32(1.0 / 127)  # |A| <= 1 (the probe's sin input)
    add(
        "QDQ int8, A too (static QuantizeLinear)",
        [
            mk("QuantizeLinear", ["A", "as", "az"], ["Aq"]),
            mk("DequantizeLinear", ["Aq", "as", "az"], ["Ad"]),
            dq,
            mk("MatMul", ["Ad", "W"], ["Y"]),
        ],
        [t(q, "Wq"), t(s, "Ws"), t(np.array(a_scale), "as"), t(np.array(128, np.uint8), "az")],
        k * n,
    )
    blocks = w.reshape(k // 256, 256, n)
    s4 = (np.abs(blocks).max(1) / 7).astype(np.float32)  # [K/256, N]
    q4 = np.clip(np.round(blocks / s4[:, None]), -7, 7).reshape(k, n)
    q4t = helper.make_tensor("Wq", TensorProto.INT4, [k, n], _pack4(q4.astype(np.int8)), raw=True)
    add(
        "QDQ int4 block 256: DequantizeLinear -> MatMul (fused: MatMulNBits)",
        [mk("DequantizeLinear", ["Wq", "Ws"], ["W"], axis=0, block_size=256), dq_mm()],
        [q4t, t(s4, "Ws")],
        k * n / 2 + 4 * s4.size,
    )
    for bits, block in ((4, 256), (8, 128)):
        b, sc = nbits_weight(w, bits, block)
        for level in (0, 1, 4):
            attrs = dict(K=k, N=n, bits=bits, block_size=block, accuracy_level=level)
            node = mk("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", **attrs)
            name = f"MatMulNBits {bits}-bit block {block}, accuracy level {level}"
            add(name, [node], [t(b, "B"), t(sc.reshape(-1), "S")], b.size + 4 * sc.size)
    return out


def kernel_rows(work: Path, k: int, n: int, builds: Path) -> dict[str, tuple[dict, float]]:
    """doel's kernel on one shape: name -> (its listing entry but the name, bytes in memory).
    One file: MatMulNBits' 4-bit bytes then its scales, as the bundle's graph holds them; the
    .wasm builds are copied from `builds` into `work` once, so every host runs the same ones."""
    b, sc = nbits_weight(weight(k, n), 4, KERNEL_BLOCK)
    path = work / f"{k}x{n}-kernel.bin"
    path.write_bytes(b.tobytes() + sc.tobytes())
    out = {}
    for kind, label in KERNELS.items():
        wasm = work / WASM[kind]
        if not wasm.exists():
            shutil.copyfile(builds / WASM[kind], wasm)
        entry = {"k": k, "n": n, "file": path, "wasm": wasm, "scales": b.size}
        out[f"doel kernel, 4-bit block {KERNEL_BLOCK} ({label})"] = (
            entry | {"block": KERNEL_BLOCK},
            b.size + sc.nbytes,
        )
    return out


def kernel_builds(work: Path) -> dict[str, str]:
    """The measured kernel builds (the copies in `work`): file name -> the start of its sha256."""
    return {
        name: hashlib.sha256((work / name).read_bytes()).hexdigest()[:16] for name in WASM.values()
    }


def dq_mm():
    return helper.make_node("MatMul", ["A", "W"], ["Y"])


def _pack4(q: np.ndarray) -> bytes:
    u = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    return (u[0::2] | (u[1::2] << 4)).tobytes()


def listed(models: list[dict], path) -> list[dict]:
    """The models as a host reads them: each file named by `path` (full, or as served)."""
    return [{k: path(v) if isinstance(v, Path) else v for k, v in m.items()} for m in models]


def run_node(mods: Path, listing: Path, threads: int, work: Path) -> dict:
    script = work / "probe.mjs"
    script.write_text(fill(NODE))
    ort = (mods / "onnxruntime-web" / "dist" / "ort.node.min.mjs").as_uri()
    cmd = ["node", str(script), ort, str(threads), str(listing)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300]}
    return {"result": json.loads(proc.stdout.strip().splitlines()[-1])}


def fill(js: str) -> str:
    rows = json.dumps([1, PREFILL])
    return (
        js.replace("%ROWS%", rows).replace("%RUNS%", str(RUNS)).replace("%BUDGET%", str(BUDGET_MS))
    )


def run_chromium(mods: Path, models: list[dict], work: Path) -> dict:
    """{build: {threads: result}} from one headless Chromium, a fresh worker per row."""
    dist = mods / "onnxruntime-web" / "dist"
    for f in dist.iterdir():
        if f.name.startswith("ort") and f.suffix in (".js", ".mjs", ".wasm"):
            os.symlink(f, work / f.name)
    (work / "probe-worker.js").write_text(fill(WORKER))
    (work / "index.html").write_text(PAGE)
    server = static_server(work)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = browser()
    out: dict = {}
    try:
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        listing = listed(models, lambda p: p.name)
        for label, build in BUILDS.items():
            for threads in THREADS:
                print(f"chromium {label}, {threads} thread(s) ...", flush=True)
                msg = {"build": build, "threads": threads, "list": listing}
                out.setdefault(label, {})[threads] = settled(
                    driver, "runProbe(arguments[0])", msg, fail=False
                )
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--no-browser", action="store_true", help="Node.js rows only")
    ap.add_argument(
        "--kernel",
        type=Path,
        default=KERNEL.parent,
        help="folder with doel's kernel builds (doel-kernel.wasm, doel-kernel-relaxed.wasm; "
        "default export/web/, the working tree's); the result records their sha256",
    )
    args = ap.parse_args(argv)
    import onnxruntime

    mods = runtime_modules()
    load_before = os.getloadavg()
    busy0, own0 = machine_busy_s(), tree_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models, memory = [], {}
        for shape, (k, n) in SHAPES.items():
            kernel = kernel_rows(work, k, n, args.kernel)
            for name, (path, mem) in graphs(work, k, n).items():
                models.append({"name": f"{shape}|{name}", "k": k, "file": path})
                memory[f"{shape}|{name}"] = mem
                if name == NBITS4:  # the table's kernel rows right under MatMulNBits 4-bit's
                    memory |= {f"{shape}|{kn}": km for kn, (_, km) in kernel.items()}
            models += [entry | {"name": f"{shape}|{kn}"} for kn, (entry, _) in kernel.items()]
        listing = work / "models.json"
        listing.write_text(json.dumps(listed(models, str)))
        builds = kernel_builds(work)
        hosts: dict = {"node": {}}
        for threads in THREADS:
            print(f"node, {threads} thread(s) ...", flush=True)
            hosts["node"][threads] = run_node(mods, listing, threads, work)
        if not args.no_browser:
            hosts |= {f"chromium {b}": r for b, r in run_chromium(mods, models, work).items()}
    chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    result = stamp(python=True) | {
        "chromium": chromium.split()[1] if chromium else None,
        "node": node,
        "onnxruntime_native": onnxruntime.__version__,
        "runtime": json.loads((Path(mods) / "onnxruntime-web" / "package.json").read_text())[
            "version"
        ],
        "settings": {"shapes": SHAPES, "rows": [1, PREFILL], "runs": RUNS, "budget_ms": BUDGET_MS},
        "kernel_sha256": builds,
        "weights_in_memory_bytes": memory,
        "hosts": hosts,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "foreign_cpu_s": max(0.0, machine_busy_s() - busy0 - (tree_cpu_s() - own0)),
    }
    text = probe_web_table.markdown(result)
    publish(args.out, f"web_probe_cpu-{result['cpu']['class']}", result, text)


if __name__ == "__main__":
    main()
