"""doel's WebAssembly kernel (export/web/kernel.c) run by Node.js on a web folder's own files:
the held-out loss of what the page computes, for bench_web beside the graphs' native loss.

Node.js 20 computes relaxed SIMD's dot product wrong (the page's dk_selftest sees it and so does
this), so this runs the plain-SIMD build; both builds sum the same integers exactly and share
every float step, so their logits are the page's. One token a forward (the kernel returns the
last row's logits), so the loss of a 0.4B model costs about a tenth of a second a token.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SCRIPT = r"""
import fs from "fs";
const [web, windowsPath, mode, logitsPath] = process.argv.slice(2);
const keep = mode === "logits"; // every position's logits instead of the summed nats
const spec = JSON.parse(fs.readFileSync(`${web}/web.json`));
const graph = spec.graphs.bundle, layout = graph.kernel;
const { instance } = await WebAssembly.instantiate(fs.readFileSync(`${web}/doel-kernel.wasm`));
const k = instance.exports;
if (k.dk_selftest() !== 1) throw new Error("the plain-SIMD kernel fails its self-test here");
const base = k.dk_alloc(graph.data_bytes);
let at = 0;
for (const p of graph.data) {
  const buf = fs.readFileSync(`${web}/${p.file}`);
  new Uint8Array(k.memory.buffer, base + at, buf.length).set(buf);
  at += buf.length;
}
const put = (Kind, xs) => {
  const p = k.dk_alloc(4 * xs.length);
  new Kind(k.memory.buffer, p, xs.length).set(xs);
  return p;
};
const cfg = put(Int32Array, layout.config), fl = put(Float32Array, layout.floats);
const off = put(Uint32Array, layout.offsets), ids = k.dk_alloc(4);
if (k.dk_init(base, cfg, fl, off) !== 0) throw new Error("dk_init found no memory");
const vocab = layout.config[6];
const out = [];
for (const w of JSON.parse(fs.readFileSync(windowsPath))) {
  let nats = 0;
  const rows = [];
  for (let t = 0; t + 1 < w.length || (keep && t < w.length); t++) {
    new Int32Array(k.memory.buffer, ids, 1)[0] = w[t];
    const at = k.dk_forward(ids, 1, t); // before reading memory.buffer: the call may grow it
    if (!at) throw new Error(`dk_forward failed at position ${t}`);
    const z = new Float32Array(k.memory.buffer, at, vocab);
    if (keep) {
      rows.push(Buffer.from(z.slice().buffer));
      continue;
    }
    let top = -Infinity, sum = 0;
    for (let i = 0; i < vocab; i++) top = Math.max(top, z[i]);
    for (let i = 0; i < vocab; i++) sum += Math.exp(z[i] - top);
    nats += top + Math.log(sum) - z[w[t + 1]];
  }
  if (keep) out.push(...rows);
  else out.push(nats);
}
if (keep) fs.writeFileSync(logitsPath, Buffer.concat(out));
else process.stdout.write(JSON.stringify(out));
"""


def kernel_nats(web_dir: Path, windows: list[list[int]]) -> list[float]:
    """Summed nats over each window's targets (w[1:] given w[:-1]), by the page's kernel."""
    return _run(web_dir, windows, "nats")


def kernel_logits(web_dir: Path, windows: list[list[int]]) -> list[np.ndarray]:
    """The page kernel's logits [len(w), vocab] after each id of each window (fed one a
    forward, as kernel_nats does)."""
    return _run(web_dir, windows, "logits")


def _run(web_dir: Path, windows: list[list[int]], mode: str):
    node = shutil.which("node")
    spec = json.loads((web_dir / "web.json").read_text())
    if node is None:
        raise RuntimeError("the kernel's loss needs Node.js (apt-get install nodejs)")
    if not spec["graphs"]["bundle"].get("kernel"):
        raise RuntimeError(f"the page has no kernel: {spec['graphs']['bundle'].get('kernel_why')}")
    with tempfile.TemporaryDirectory() as tmp:
        script, wins, logits = (Path(tmp) / n for n in ("loss.mjs", "windows.json", "logits"))
        script.write_text(SCRIPT)
        wins.write_text(json.dumps(windows))
        cmd = [node, str(script), str(web_dir), str(wins), mode, str(logits)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"node failed: {proc.stderr[-1500:]}")
        if mode != "logits":
            return json.loads(proc.stdout)
        flat = np.fromfile(logits, np.float32).reshape(-1, spec_vocab(spec))
    cut = np.cumsum([len(w) for w in windows])[:-1]
    return np.split(flat, cut)


def spec_vocab(spec: dict) -> int:
    return spec["graphs"]["bundle"]["kernel"]["config"][6]
