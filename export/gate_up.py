"""Each layer's gate and up projections as one MatMulNBits of 2N rows and a Split.

The builder writes the MLP's gate and up as two MatMulNBits of the same input, K, bits, block and
accuracy level: each call quantizes the one activation row to int8 and dispatches its own
threads. Here they become one MatMulNBits whose weights are the two concatenated along N (B is
[N, K / block, bytes] a matrix, the scales [N * K / block], and zero points and bias where there
are any): its first N outputs are the gate's, the next N the up's, and a Split gives them back
under their old names to the SiLU-multiply. The bytes a token streams are the same and the
outputs equal bit for bit; a decode step makes one call and one quantization of the row fewer a
layer (benchmarks/probes/probe_gate_up.py measures what that saves, docs/kernels.md).

The fused node is named `.../mlp/gate_up_proj/MatMul_Q*` and its weights
`model.layers.{i}.mlp.gate_up_proj.MatMul.weight_Q*` / `..._scales`; the page's kernel reads the
two halves by offset into it (export/web_kernel.py). The bundle stays a standard ONNX file:
MatMulNBits and Split are what onnxruntime-genai and ONNX Runtime Mobile already run.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from doel.export.onnxfile import load_weights, save_rewritten

ENV = "DOEL_EXPORT_GATE_UP"  # "0": leave gate and up as the builder wrote them
NAME = "gate_up_proj"
ATTRS = ("K", "bits", "block_size", "accuracy_level")
# MatMulNBits inputs: A, B, scales, zero_points, g_idx, bias (the last four optional)
ROW_INPUTS = (1, 2, 3, 5)  # concatenated along N; g_idx (4) is along K and must be absent


def enabled() -> bool:
    """Whether the export fuses gate|up: on unless DOEL_EXPORT_GATE_UP=0."""
    return os.environ.get(ENV, "1") != "0"


def node_attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def pairs(graph) -> list[tuple[int, int]]:
    """(gate, up) node indices of each layer: two MatMulNBits of one input whose names hold
    gate_proj and up_proj, with equal K, N, bits, block, accuracy level and optional inputs."""
    by_input: dict[str, dict[str, int]] = {}
    for i, n in enumerate(graph.node):
        if n.op_type != "MatMulNBits":
            continue
        role = "gate" if "gate_proj" in n.name else "up" if "/up_proj" in n.name else None
        if role:
            by_input.setdefault(n.input[0], {})[role] = i
    out = []
    for roles in by_input.values():
        if set(roles) != {"gate", "up"}:
            continue
        g, u = graph.node[roles["gate"]], graph.node[roles["up"]]
        ga, ua = node_attrs(g), node_attrs(u)
        present = [[bool(x) for x in n.input[3:]] + [False] * (6 - len(n.input)) for n in (g, u)]
        if any(ga.get(k) != ua.get(k) for k in (*ATTRS, "N")) or present[0] != present[1]:
            continue
        if len(g.input) > 4 and g.input[4]:  # g_idx: a permutation of K, not concatenable
            continue
        out.append((roles["gate"], roles["up"]))
    return sorted(out)


def fuse_gate_up(model, found: list[tuple[int, int]] | None = None) -> int:
    """Replace each layer's gate and up MatMulNBits of `model` (an onnx.ModelProto, its weights
    in memory) by one of 2N rows and a Split; the number of layers fused. `found`: pairs(), where
    the caller has it."""
    g = model.graph
    found = pairs(g) if found is None else found
    inits = {t.name: t for t in g.initializer}

    def read(name: str) -> np.ndarray:
        return numpy_helper.to_array(inits[name])

    drop_inits: set[str] = set()
    new_inits, replace, drop_nodes = [], {}, set()
    for gi, ui in found:
        gate, up = g.node[gi], g.node[ui]
        a = node_attrs(gate)
        n = int(a["N"])
        name = gate.name.replace("gate_proj", NAME)
        ins = [gate.input[0]]
        for k in range(1, len(gate.input)):
            if k not in ROW_INPUTS or not gate.input[k]:
                ins.append(gate.input[k])
                continue
            joined = np.concatenate([read(x.input[k]) for x in (gate, up)], axis=0)
            tensor = numpy_helper.from_array(joined, gate.input[k].replace("gate_proj", NAME))
            new_inits.append(tensor)
            drop_inits.update((gate.input[k], up.input[k]))
            ins.append(tensor.name)
        split = f"{name}/split"
        new_inits.append(numpy_helper.from_array(np.array([n, n], np.int64), split))
        fused = f"{name}/output_0"
        mm = helper.make_node(
            "MatMulNBits", ins, [fused], name=name, domain="com.microsoft", **(a | {"N": 2 * n})
        )
        sp = helper.make_node(
            "Split", [fused, split], [gate.output[0], up.output[0]], name=f"{name}/Split", axis=-1
        )
        replace[gi] = [mm, sp]
        drop_nodes.add(ui)
    if not replace:
        return 0
    nodes = []
    for i, node in enumerate(g.node):
        if i not in drop_nodes:
            nodes.extend(replace.get(i, [node]))
    del g.node[:]
    g.node.extend(nodes)
    kept = [t for t in g.initializer if t.name not in drop_inits] + new_inits
    del g.initializer[:]
    g.initializer.extend(kept)
    return len(replace)


def fuse_model_file(model: Path) -> int:
    """Rewrite `model` (and its external weights file) with gate|up fused; the number of layers
    fused (0: left alone, no pair found)."""
    m = onnx.load(str(model), load_external_data=False)
    found = pairs(m.graph)
    if not found:
        return 0
    location = load_weights(m, model)
    fused = fuse_gate_up(m, found)
    save_rewritten(m, model, location)
    return fused


def halves(graph) -> dict[str, dict]:
    """{fused node name: {"N": rows of each half, "B": bytes of one half's B, "scales": bytes
    of one half's scales}}: where the up half starts in the fused weights (web_kernel.py)."""
    out = {}
    for n in graph.node:
        if n.op_type == "MatMulNBits" and NAME in n.name:
            a = node_attrs(n)
            half, blocks = int(a["N"]) // 2, -(-int(a["K"]) // int(a["block_size"]))
            blob = int(a["block_size"]) * int(a["bits"]) // 8
            out[n.name] = {"N": half, "B": half * blocks * blob, "scales": half * blocks * 4}
    return out
