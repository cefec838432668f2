"""The token embedding table of a quantized bundle, stored in 8 bits.

Builders leave the table fp32 (onnxruntime-genai keeps it apart from the head), and a token reads
one row of it: in fp32 it is a large share of a quantized model's memory, resident in a server for
nothing. Here the table's Gather becomes ONNX Runtime's contrib op GatherBlockQuantized:
symmetric int8 in blocks of `block_size` along the hidden axis, one fp32 scale per block, stored as
uint8 with the op's default zero point of 128, a quarter of the fp32 bytes and its scales. A step
gathers a few rows, so the dequantization costs no measurable time.

8 bits at int4 too: the table is not where int4 loses memory or speed, and 8 bits keep its error
far below the weights' (the embedding column of benchmarks/results/quant_quality_small.md). The
export's parity checks and loss bound run on the graph after this step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BITS = 8
ZERO_POINT = 1 << (BITS - 1)  # GatherBlockQuantized's default for uint8 data
QMAX = ZERO_POINT - 1  # symmetric: -127..127, so -x quantizes to -q


def quantize_rows(table: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 data [V, H], fp32 scales [V, H / block_size]) with table ≈ (data - 128) * scale."""
    v, h = table.shape
    blocks = table.reshape(v, h // block_size, block_size).astype(np.float32)
    scales = np.abs(blocks).max(axis=-1) / QMAX
    scales[scales == 0] = 1.0  # an all-zero block: any scale gives zeros
    q = np.clip(np.rint(blocks / scales[..., None]), -QMAX, QMAX)
    return (q + ZERO_POINT).astype(np.uint8).reshape(v, h), scales.astype(np.float32)


def dequantize_rows(data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    v, h = data.shape
    blocks = data.reshape(v, scales.shape[1], -1).astype(np.float32) - ZERO_POINT
    return (blocks * scales[..., None]).reshape(v, h)


def _embedding_gather(graph):
    """The Gather that reads the table with the input ids, if its table is used by it alone."""
    inits = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type != "Gather" or node.input[1] != "input_ids" or node.input[0] not in inits:
            continue
        users = sum(node.input[0] in n.input for n in graph.node)
        if users == 1 and len(inits[node.input[0]].dims) == 2:
            return node, inits[node.input[0]]
    return None, None


def quantize_embedding(model: Path, block_size: int) -> bool:
    """Rewrite `model` (and its external weights file) with an 8-bit embedding table; returns
    False, leaving it alone, when there is no such table of its own (a table shared with the
    head) or no block size of 16 or more divides the hidden size. The table's block is the
    largest power of two up to `block_size` that divides the hidden size (a tiny model's 64
    under int4's 128)."""
    import onnx
    from onnx import helper, numpy_helper

    from doel.export.onnxfile import load_weights, save_rewritten

    m = onnx.load(str(model), load_external_data=False)
    node, init = _embedding_gather(m.graph)
    if node is None:
        return False
    block_size = next(
        (b for b in (256, 128, 64, 32, 16) if b <= block_size and not init.dims[1] % b), 0
    )
    if not block_size:
        return False
    location = load_weights(m, model)
    data, scales = quantize_rows(numpy_helper.to_array(init), block_size)
    name = init.name
    m.graph.initializer.remove(init)
    m.graph.initializer.extend(
        [
            numpy_helper.from_array(data, f"{name}/quantized"),
            numpy_helper.from_array(scales, f"{name}/scales"),
        ]
    )
    gbq = helper.make_node(
        "GatherBlockQuantized",
        [f"{name}/quantized", node.input[1], f"{name}/scales"],
        list(node.output),
        name=node.name + "BlockQuantized",
        domain="com.microsoft",
        bits=BITS,
        block_size=block_size,
        gather_axis=0,
        quantize_axis=1,
    )
    at = list(m.graph.node).index(node)
    m.graph.node.remove(node)
    m.graph.node.insert(at, gbq)
    if not any(o.domain == "com.microsoft" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save_rewritten(m, model, location)
    return True


def describe(model: Path) -> str:
    """The manifest's words for how the graph stores its embedding table."""
    import onnx

    for node in onnx.load(str(model), load_external_data=False).graph.node:
        if node.op_type == "GatherBlockQuantized" and node.input[1] == "input_ids":
            attrs = {a.name: a.i for a in node.attribute}
            return (
                f"int{attrs['bits']} GatherBlockQuantized, symmetric, block {attrs['block_size']}"
                " along the hidden axis, fp32 scales (one row read per token)"
            )
    return "fp32 (Gather, one row read per token)"
