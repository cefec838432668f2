"""The KV cache of a quantized builder graph in fp16 or int8: half or a quarter of the cache's
memory and reads.

fp16 (`half_kv_cache`): GroupQueryAttention runs in fp16 on the CPU too (the cache's type is the
query's), so each attention node gets a Cast of its packed QKV input to fp16 and a Cast of its
output back to fp32, and fp16 copies of the rotary tables (benchmarks/results/phone_memory_0.4b.md).

int8 (`int8_kv_cache`): ONNX Runtime's GroupQueryAttention quantizes each new key and value as it
writes the cache (`kv_cache_bit_width` 8, symmetric, one fp32 scale per channel of each KV head,
saturating) and reads it back in its attention kernel: no Cast nodes, the query stays fp32. The
scales are fixed in the graph, so they come from running the fp32-cache graph over calibration
text (`calibrate`): a value channel's largest magnitude, and for keys the largest norm of each
rotary pair, which the rotation by position moves between the pair's two channels, so a key seen
at one position fits at every other. Measured against fp32 in benchmarks/results/kv_int8_*.

Either way the graph's `past_key_values.*` inputs and `present.*` outputs change type; everything
else (MatMulNBits, norms, the head) stays fp32, and fp32 bundles keep an fp32 cache: they are the
exact reference. The export's parity checks and loss bound run after this step.
"""

from __future__ import annotations

from pathlib import Path

ROTARY_INPUTS = (7, 8)  # GroupQueryAttention's cos_cache and sin_cache


def _gqa_nodes(graph) -> list:
    return [n for n in graph.node if n.op_type == "GroupQueryAttention"]


def _cache_nodes(model: Path) -> tuple:
    """(the loaded graph, its GroupQueryAttention nodes), the nodes empty unless each reads its
    cache from a graph input (optimum's graphs: their attention is plain ops)."""
    import onnx

    m = onnx.load(str(model), load_external_data=False)
    nodes = _gqa_nodes(m.graph)
    inputs = {i.name for i in m.graph.input}
    return m, nodes if all(n.input[3] in inputs for n in nodes) else []


def _retype_cache(m, elem_type: int) -> None:
    """The graph's past_key_values.* inputs and present.* outputs, as `elem_type`."""
    for v in [*m.graph.input, *m.graph.output]:
        if v.name.startswith(("past_key_values.", "present.")):
            v.type.tensor_type.elem_type = elem_type


def half_kv_cache(model: Path) -> bool:
    """Rewrite `model` so that its cache is fp16; False (left alone) without GroupQueryAttention
    nodes on graph inputs (optimum's graphs: their attention is plain ops)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m, nodes = _cache_nodes(model)
    if not nodes:
        return False
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    halves: dict[str, str] = {}
    for node in nodes:
        at = list(g.node).index(node)
        qkv, out = node.input[0], node.output[0]
        node.input[0], node.output[0] = f"{qkv}/fp16", f"{out}/fp16"
        for i in ROTARY_INPUTS:
            name = node.input[i]
            if name not in halves:  # one table for every layer
                table = numpy_helper.to_array(inits[name], str(model.parent)).astype(np.float16)
                halves[name] = f"{name}/fp16"
                g.initializer.append(numpy_helper.from_array(table, halves[name]))
            node.input[i] = halves[name]
        cast_in = helper.make_node(
            "Cast", [qkv], [node.input[0]], name=f"{node.name}/CastIn", to=TensorProto.FLOAT16
        )
        cast_out = helper.make_node(
            "Cast", [node.output[0]], [out], name=f"{node.name}/CastOut", to=TensorProto.FLOAT
        )
        g.node.insert(at, cast_in)
        g.node.insert(at + 2, cast_out)
    for name in halves:  # the fp32 tables have no reader left
        g.initializer.remove(inits[name])
    _retype_cache(m, TensorProto.FLOAT16)
    onnx.save(m, str(model))
    return True


SCALE_FLOOR = 1e-6  # a channel silent in the calibration text still gets a usable scale
K_SCALE = 12  # GroupQueryAttention's k_scale input, v_scale the next (ONNX Runtime 1.32)


def calibrate(model: Path, kv_heads: int, head_dim: int, docs) -> dict:
    """{cache input name: largest |entry| per KV head and channel, [kv_heads, head_dim]} over
    `docs` (lists of token ids, each one run), through `model` with its fp32 cache."""
    import numpy as np

    from doel.export.runner import OnnxLM

    lm = OnnxLM(model, kv_heads, head_dim)
    peak: dict = {}
    for ids in docs:
        _, present = lm.step(np.array([ids]), lm.empty_past(1), 0)
        for name, v in present.items():  # [1, kv_heads, n, head_dim]
            top = np.abs(v[0]).max(axis=1)
            peak[name] = top if name not in peak else np.maximum(peak[name], top)
    if not peak:
        raise ValueError("no calibration text: the int8 cache's scales need some")
    return peak


def kv_scales(peak: dict, interleaved: bool = False) -> dict:
    """int8 scales [kv_heads, 1, head_dim] per cache input from `calibrate`'s peaks: a key
    channel's scale is its rotary pair's (channels i and i + head_dim/2, or 2i and 2i+1 when the
    rotary is interleaved) largest norm, a value channel's its own largest magnitude."""
    import numpy as np

    out = {}
    for name, top in peak.items():
        top = np.asarray(top, np.float32)
        if name.endswith(".key"):
            half = top.shape[-1] // 2
            a, b = (top[:, 0::2], top[:, 1::2]) if interleaved else (top[:, :half], top[:, half:])
            pair = np.sqrt(a * a + b * b)
            top = np.repeat(pair, 2, axis=1) if interleaved else np.concatenate([pair, pair], 1)
        out[name] = np.maximum(top / 127.0, SCALE_FLOOR).astype(np.float32)[:, None, :]
    return out


def int8_kv_cache(model: Path, peak: dict) -> bool:
    """Rewrite `model` so that its cache is int8, scaled from `calibrate`'s `peak` (`kv_scales`,
    pairing channels as the nodes' rotary does); False (left alone) without GroupQueryAttention
    nodes on graph inputs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m, nodes = _cache_nodes(model)
    if not nodes:
        return False
    g = m.graph
    rotary = {a.i for n in nodes for a in n.attribute if a.name == "rotary_interleaved"}
    scales = kv_scales(peak, interleaved=rotary == {1})
    for node in nodes:
        named = []
        for i in (3, 4):  # its past key and value
            name = f"{node.input[i]}/int8_scale"
            g.initializer.append(numpy_helper.from_array(scales[node.input[i]], name))
            named.append(name)
        ins = list(node.input)[:K_SCALE] + [""] * max(0, K_SCALE - len(node.input))
        del node.input[:]
        node.input.extend([*ins, *named])
        node.attribute.extend(
            [
                helper.make_attribute("kv_cache_bit_width", 8),
                helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                helper.make_attribute("v_quant_type", "PER_CHANNEL"),
            ]
        )
    _retype_cache(m, TensorProto.INT8)
    onnx.save(m, str(model))
    return True
