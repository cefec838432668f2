"""The browser page's graphs of a bundle's ONNX model (`doel-export --web`), each with its own
weights (the page fetches one set):
- `bundle` (model.onnx): the bundle's own graph, MatMulNBits and all. WebGPU runs it on its 4-bit
  kernels and WebAssembly on doel's kernel (web_kernel); onnxruntime-web's own WebAssembly
  MatMulNBits is its slowest mode.
- `int8` (model.int8.onnx): each MatMulNBits as DynamicQuantizeMatMul over int8 weights with one
  scale a column: 8 bits in memory at about an fp32 MatMul's speed in onnxruntime-web's
  WebAssembly build, the page's mode where the kernel cannot run. Its values are the bundle's
  weights requantized a column: one more rounding, of at most half a 127th of the column's
  largest weight.
- `fp32` (model.fp32.onnx, for the benchmarks' fp32 mode): each MatMulNBits as DequantizeLinear
  + MatMul, which ONNX Runtime folds into fp32 matrices at load when its QDQ rules are off. Its
  WebGPU build does not fuse the pair back into MatMulNBits (it would dequantize every run): WebGPU
  gets the bundle's graph.
- `logits_to_keep` (an overridable initializer of the builder's graph) becomes a plain input in
  each: the page feeds only inputs without an initializer.
What each costs: benchmarks/results/web_probe_cpu-intel-avx512-amx.md (one layer),
benchmarks/results/web_demo_0.4b_t1_cpu-intel-avx512-amx.md (the page).

The bundle's weights file is read here (`load_weights`), not by onnx.load: onnx refuses a data
file with more than one hard link (its guard against a model that names a linked-in secret), and
a bundle copied with `cp -l` or kept in a deduplicating store is exactly that. The user runs this
on their own bundle, so the check kept is that the file lies inside its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from doel.export.common import ExportError

LOGITS_TO_KEEP = "logits_to_keep"


def unpack_nbits(b: np.ndarray, bits: int, k: int) -> np.ndarray:
    """MatMulNBits' weight [N, blocks, bytes] (uint8, zero point 2^(bits-1), the builder's
    symmetric form) as signed integers [N, K]."""
    flat = b.reshape(b.shape[0], -1).astype(np.int16)
    if bits == 4:
        flat = np.stack([flat & 0xF, flat >> 4], axis=-1).reshape(b.shape[0], -1)
    return (flat[:, :k] - (1 << (bits - 1))).astype(np.int8)


def _int4_tensor(name: str, q: np.ndarray) -> onnx.TensorProto:
    """ONNX INT4 [K, N]: two values a byte, the first in the low nibble."""
    u = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    raw = (u[0::2] | (u[1::2] << 4)).tobytes()
    return onnx.helper.make_tensor(name, onnx.TensorProto.INT4, list(q.shape), raw, raw=True)


def _nbits(g: onnx.GraphProto):
    """Each MatMulNBits without zero points: (node, attributes, integers [K, N], scales
    [blocks, N]); the node's weight initializers are removed from the graph."""
    inits = {t.name: t for t in g.initializer}
    for node in [n for n in g.node if n.op_type == "MatMulNBits" and len(n.input) == 3]:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        k, n = a["K"], a["N"]
        q = unpack_nbits(numpy_helper.to_array(inits[node.input[1]]), a["bits"], k).T.copy()
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1).T.astype(np.float32)
        for name in node.input[1:]:
            g.initializer.remove(inits[name])
        yield node, a, q, np.ascontiguousarray(scales)


def _replace(g: onnx.GraphProto, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    at = list(g.node).index(node)
    g.node.remove(node)
    for n in reversed(new):
        g.node.insert(at, n)


def dequantize_nodes(g: onnx.GraphProto) -> int:
    """Each MatMulNBits without zero points becomes DequantizeLinear (the same integers and
    scales, blocked along K) + MatMul; returns how many."""
    count = 0
    for node, a, q, scales in list(_nbits(g)):
        names = [f"{node.name}/{x}" for x in ("q", "scales", "weight")]
        qt = _int4_tensor(names[0], q) if a["bits"] == 4 else numpy_helper.from_array(q, names[0])
        g.initializer.extend([qt, numpy_helper.from_array(scales, names[1])])
        dq = onnx.helper.make_node(
            "DequantizeLinear",
            names[:2],
            names[2:],
            name=f"{node.name}/DQ",
            axis=0,
            block_size=a["block_size"],
        )
        mm = onnx.helper.make_node(
            "MatMul", [node.input[0], names[2]], list(node.output), name=f"{node.name}/MatMul"
        )
        _replace(g, node, [dq, mm])
        count += 1
    return count


def column_int8(q: np.ndarray, scales: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocked integers [K, N] and scales [blocks, N] as int8 with one scale a column:
    (int8 [K, N], scales [N])."""
    w = q.astype(np.float32) * np.repeat(scales, block, axis=0)[: q.shape[0]]
    col = np.abs(w).max(0) / 127
    col[col == 0] = 1.0
    return np.clip(np.round(w / col), -127, 127).astype(np.int8), col.astype(np.float32)


def int8_nodes(g: onnx.GraphProto) -> int:
    """Each MatMulNBits without zero points becomes DynamicQuantizeMatMul over int8 weights with
    one scale a column (symmetric: no zero points); returns how many."""
    count = 0
    for node, a, q, scales in list(_nbits(g)):
        w8, col = column_int8(q, scales, a["block_size"])
        names = [f"{node.name}/w8", f"{node.name}/w8_scale"]
        g.initializer.extend(
            [numpy_helper.from_array(w8, names[0]), numpy_helper.from_array(col, names[1])]
        )
        dqmm = onnx.helper.make_node(
            "DynamicQuantizeMatMul",
            [node.input[0], *names],
            list(node.output),
            name=f"{node.name}/DQMatMul",
            domain="com.microsoft",
        )
        _replace(g, node, [dqmm])
        count += 1
    return count


def _tensors(g: onnx.GraphProto):
    """Every tensor of the graph that can hold external data: initializers, and attributes'
    (Constant nodes' values, subgraphs')."""
    yield from g.initializer
    for node in g.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _tensors(sub)


def load_weights(m: onnx.ModelProto, folder: Path) -> None:
    """The external weights of `m` (loaded without them) from their files in `folder`, into
    the tensors, as onnx.load would, but whatever the files' link counts; a file outside the
    folder or a range past its end is refused."""
    root, files = folder.resolve(), {}
    try:
        for t in _tensors(m.graph):
            if not external_data_helper.uses_external_data(t):
                continue
            info = external_data_helper.ExternalDataInfo(t)
            path = (folder / info.location).resolve()
            if not path.is_relative_to(root) or not path.is_file():
                raise ExportError(
                    f"{t.name}'s weights are in {info.location!r}, not a file in {folder}: "
                    "export the bundle again"
                )
            if path not in files:
                files[path] = path.open("rb")
            f = files[path]
            size, at = os.fstat(f.fileno()).st_size, info.offset or 0
            length = size - at if info.length is None else info.length
            if at + length > size:
                raise ExportError(
                    f"{t.name}'s weights run past the end of {path}: copy the bundle again"
                )
            f.seek(at)
            t.raw_data = f.read(length)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    finally:
        for f in files.values():
            f.close()


def web_graph(src: Path, out: Path, model: str, data: str, weights: str = "bundle") -> dict:
    """The page's `weights` graph of `src` in out/`model`, its weights in out/`data`:
    logits_to_keep a plain input; MatMulNBits kept (`bundle`), as DynamicQuantizeMatMul (`int8`)
    or as DequantizeLinear + MatMul (`fp32`, where the opset has blocked DequantizeLinear: 21)."""
    m = onnx.load(str(src), load_external_data=False)
    load_weights(m, src.parent)  # the weights too: the quantized ones are rewritten
    g = m.graph
    inputs = {i.name for i in g.input}
    found = [t for t in g.initializer if t.name == LOGITS_TO_KEEP and t.name in inputs]
    for t in found:
        g.initializer.remove(t)
    rewritten = 0
    if weights == "int8":
        rewritten = int8_nodes(g)
    elif weights == "fp32":
        opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
        rewritten = dequantize_nodes(g) if opset >= 21 else 0
    # Every weight in the data file, however small (doel's kernel reads them all from it), but
    # integer tensors (shapes, axes) inline: onnxruntime-web's shape inference reads them at
    # load and cannot from external data ("Cannot parse data from external tensors").
    external_data_helper.convert_model_to_external_data(
        m, all_tensors_to_one_file=True, location=data, size_threshold=0
    )
    for t in g.initializer:
        if t.data_type == onnx.TensorProto.INT64:
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
    onnx.save(m, str(out / model))
    return {"logits_to_keep": bool(found), "rewritten_matmuls": rewritten}
