"""export/web/kernel.c's 4-bit matmul (dk_linear) in Node against numpy, on random MatMulNBits
weights (4 bits, zero point 8): within the activations' int8 rounding of the dequantized matmul,
and equal (to float rounding) to numpy doing the kernel's own integer arithmetic. Shapes reach
every tile of the kernel (rows 1 and 3: four weight rows at a time and the leftover one; 12:
a prefill tile and rows left over; 128: the prefill tiles). The plain-SIMD build always; the relaxed
build only where its dk_selftest says the engine computes its dot right (Node 20 does not)."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from doel.export.web_kernel import KERNEL, WASM

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs node (Node.js) on PATH")
# (rows, K, N, block): N not a multiple of 4 leaves a weight row to the one-at-a-time path
CASES = [(1, 256, 13, 256), (3, 512, 13, 256), (12, 512, 8, 64), (128, 256, 20, 256)]
CASES += [(128, 512, 13, 256)]

RUN = r"""
const fs = require('fs');
const [wasm, dir] = process.argv.slice(2);
const spec = JSON.parse(fs.readFileSync(dir + '/spec.json'));
WebAssembly.instantiate(fs.readFileSync(wasm), {}).then(({ instance }) => {
  const k = instance.exports, out = { selftest: k.dk_selftest(), ys: [] };
  spec.forEach((c, i) => {
    const put = (name) => {
      const b = fs.readFileSync(`${dir}/${name}${i}`), at = k.dk_alloc(b.length);
      new Uint8Array(k.memory.buffer, at, b.length).set(b);
      return at;
    };
    const a = put('a'), w = put('w'), s = put('s'), y = k.dk_alloc(4 * c.rows * c.N);
    k.dk_linear(y, a, c.rows, c.K, c.N, w, s, c.block);
    out.ys.push(Array.from(new Float32Array(k.memory.buffer, y, c.rows * c.N)));
  });
  console.log(JSON.stringify(out));
});
"""


def _case(rng, rows, K, N, block):
    """Activations, packed weights (element 2i in byte i's low nibble), scales, nibbles."""
    a = (rng.standard_normal((rows, K)) * rng.uniform(0.1, 3.0, (rows, 1))).astype(np.float32)
    if K > block:
        a[-1, :block] = 0.0  # an all-zero block: scale 0, no division by it
    nib = rng.integers(0, 16, (N, K), dtype=np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    s = rng.uniform(0.001, 0.05, (N, K // block)).astype(np.float32)
    return a, packed, s, nib


def _kernel_ints(a, block):
    """The kernel's quantization, in float32 as it does it: integers and per-block scales."""
    blocks = a.reshape(a.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.int64)
    return q, (amax / np.float32(127)).astype(np.float32)[..., 0]


def _run(wasm, cases, tmp_path, flags=()):
    spec = []
    for i, (a, packed, s, _nib, block) in enumerate(cases):
        (tmp_path / f"a{i}").write_bytes(a.tobytes())
        (tmp_path / f"w{i}").write_bytes(packed.tobytes())
        (tmp_path / f"s{i}").write_bytes(s.tobytes())
        spec.append({"rows": a.shape[0], "K": a.shape[1], "N": s.shape[0], "block": block})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "run.js").write_text(RUN)
    cmd = [NODE, *flags, str(tmp_path / "run.js"), str(wasm), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("kind", ["simd", "relaxed"])
def test_dk_linear_is_numpys_matmul_within_the_int8_rounding(kind, tmp_path):
    rng = np.random.default_rng(7)
    cases = [(*_case(rng, r, k, n, b), b) for r, k, n, b in CASES]
    flags = ["--experimental-wasm-relaxed-simd"] if kind == "relaxed" else []
    out = _run(KERNEL.parent / WASM[kind], cases, tmp_path, flags)
    if kind == "relaxed" and out["selftest"] != 1:
        pytest.skip("this Node computes relaxed SIMD's i8 x i7 dot otherwise (dk_selftest 0)")
    assert out["selftest"] == 1
    for (a, _packed, s, nib, block), y in zip(cases, out["ys"]):
        rows, K = a.shape
        y = np.array(y).reshape(rows, -1)
        w = (nib.astype(np.float64) - 8).reshape(len(s), -1, block) * s[..., None]
        exact = a.astype(np.float64) @ w.reshape(len(s), K).T
        # each activation is off by at most half its block's step (amax / 127 / 2)
        step = np.abs(a).reshape(rows, -1, block).max(axis=2) / 127 / 2
        bound = np.einsum("rb,nbk->rn", step, np.abs(w)) + 1e-4
        assert (np.abs(y - exact) <= bound).all(), (rows, K, np.abs(y - exact).max())
        assert np.abs(y - exact).max() > 0  # the activations really were rounded
        q, sc = _kernel_ints(a, block)
        dots = np.einsum("rbk,nbk->rnb", q, nib.reshape(len(s), -1, block).astype(np.int64) - 8)
        ints = np.einsum("rnb,nb,rb->rn", dots.astype(np.float64), s, sc)
        np.testing.assert_allclose(y, ints, rtol=1e-5, atol=1e-5)
