"""doel's WebAssembly kernel for the page (export/web_kernel.py, export/web/kernel.c): the
committed .wasm files are kernel.c's build, and kernel_layout finds every tensor of the
builder's int4 graph where it lies in the weights file, or refuses any other graph by name.
(The page's greedy ids and logits on it: tests/export/test_web.py.)"""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from doel.export.web_kernel import WASM, NotKernelShape, build, kernel_layout


@pytest.mark.skipif(importlib.util.find_spec("ziglang") is None, reason="pip install ziglang")
def test_the_committed_wasm_files_are_kernel_c_built(tmp_path):
    from doel.export.web_kernel import KERNEL

    for made in build(tmp_path):
        committed = KERNEL.parent / made.name
        assert made.read_bytes() == committed.read_bytes(), (
            f"{committed.name} is not kernel.c's build: run python -m doel.export.web_kernel"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(WASM.values())


@pytest.fixture(scope="module")
def web_graph_dir(tiny_bundle, tmp_path_factory):
    """tiny_bundle's checkpoint at int4, and the page's copy of its graph (export/web_graph)."""
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.web_graph import web_graph

    root = tmp_path_factory.mktemp("kernel")
    opts = ExportOptions(quant="int4", eval_tokens=32, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", root / "bundle", opts)
    web_graph(root / "bundle" / "model.onnx", root, "model.onnx", "model.web.data")
    return root


def test_the_layout_points_at_each_tensor_of_the_graph(web_graph_dir, tiny_model_config):
    c = tiny_model_config
    layout = kernel_layout(web_graph_dir / "model.onnx")
    layers, d, heads, kv_heads, head_dim, ffn, vocab = layout["config"][:7]
    assert (layers, d, heads, kv_heads, ffn) == (
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
    )
    assert head_dim == d // heads and vocab >= c.vocab_size
    assert len(layout["offsets"]) == len(layout["tensors"]) == 7 + 12 * layers
    # each offset holds its tensor's bytes
    data = (web_graph_dir / "model.web.data").read_bytes()
    m = onnx.load(str(web_graph_dir / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    for name, at in zip(layout["tensors"], layout["offsets"]):
        if name.endswith(" (up half)"):  # gate|up fused (export/gate_up.py): its second N rows
            whole = inits[name.removesuffix(" (up half)")].tobytes()
            raw = whole[len(whole) // 2 :]
        else:
            raw = inits[name].tobytes()
        assert data[at : at + len(raw)] == raw, name
    # gate|up are one matrix a layer (the default export): the kernel reads its two halves
    assert layout["tensors"][7 + 6].endswith("layers.0.mlp.gate_up_proj.MatMul.weight_Q4")
    assert layout["tensors"][7 + 8].endswith("gate_up_proj.MatMul.weight_Q4 (up half)")
    # each layer's number after the config's 11 says which of its matrices are 8-bit: those the
    # export's mixed placement keeps finer (doel.contracts.quant's promoted_bits)
    eight = layout["config"][11:]
    assert len(eight) == layers and eight[0] == 1 | 4  # the first layer: QKV and down
    for i, flags in enumerate(eight):
        for slot, flag in ((1, 1), (3, 2), (10, 4)):  # qkv_w, o_w, down_w in LAYER
            name = layout["tensors"][7 + 12 * i + slot]
            assert name.endswith("_Q8" if flags & flag else "_Q4"), name
    assert layout["tensors"][7 + 1].endswith("layers.0.attn.qkv_proj.MatMul.weight_Q8")
    assert layout["floats"][1] == pytest.approx(head_dim**-0.5)


def _edited(src, out, edit):
    m = onnx.load(str(src), load_external_data=False)
    edit(m.graph)
    onnx.save(m, str(out))
    return out


def _first(g, op):
    return next(n for n in g.node if n.op_type == op)


def _zero_points(g):
    node = _first(g, "MatMulNBits")
    g.initializer.append(numpy_helper.from_array(np.zeros(4, np.uint8), "zp"))
    node.input.append("zp")


def _interleaved(g):
    attr = next(a for a in _first(g, "GroupQueryAttention").attribute if a.name.startswith("rot"))
    attr.i = 1


def _unknown_op(g):
    g.node.append(helper.make_node("Erf", ["logits"], ["erf_out"], name="extra_erf"))


@pytest.mark.parametrize(
    "edit, says",
    [(_zero_points, "zero points"), (_interleaved, "rotary"), (_unknown_op, "Erf node")],
)
def test_another_graph_is_refused_by_name(web_graph_dir, edit, says):
    path = _edited(web_graph_dir / "model.onnx", web_graph_dir / f"{edit.__name__}.onnx", edit)
    with pytest.raises(NotKernelShape, match=says):
        kernel_layout(path)


def test_an_fp32_graph_is_not_the_kernels(tiny_bundle):
    with pytest.raises(NotKernelShape, match=r"^a \w+ node \("):
        kernel_layout(tiny_bundle / "model.onnx")
