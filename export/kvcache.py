"""The KV cache of a quantized builder graph in fp16: half the cache's memory and reads
(benchmarks/results/phone_memory_0.4b.md).

GroupQueryAttention runs in fp16 on the CPU too (the cache's type is the query's), so each
attention node gets a Cast of its packed QKV input to fp16 and a Cast of its output back to fp32,
fp16 copies of the rotary tables, and the graph's `past_key_values.*` inputs and `present.*`
outputs become fp16. Everything else (MatMulNBits, norms, the head) stays fp32, and fp32 bundles
keep an fp32 cache: they are the exact reference. The export's parity checks and loss bound run
after this step.
"""

from __future__ import annotations

from pathlib import Path

ROTARY_INPUTS = (7, 8)  # GroupQueryAttention's cos_cache and sin_cache


def _gqa_nodes(graph) -> list:
    return [n for n in graph.node if n.op_type == "GroupQueryAttention"]


def half_kv_cache(model: Path) -> bool:
    """Rewrite `model` so that its cache is fp16; False (left alone) without GroupQueryAttention
    nodes on graph inputs (optimum's graphs: their attention is plain ops)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load(str(model), load_external_data=False)
    g = m.graph
    nodes = _gqa_nodes(g)
    inputs = {i.name for i in g.input}
    if not nodes or not all(n.input[3] in inputs for n in nodes):
        return False
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
    for v in [*g.input, *g.output]:
        if v.name.startswith(("past_key_values.", "present.")):
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.save(m, str(model))
    return True
