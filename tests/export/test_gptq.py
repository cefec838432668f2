"""Calibrated rounding (export/gptq.py): its weights lie on MatMulNBits' own grid, so the
builder's round-to-nearest gives them back exactly; it beats round-to-nearest on the layer's
output; the loss check's text is never its calibration; bad requests are one-line errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch")


def _mlas(w: np.ndarray, bits: int, block: int) -> np.ndarray:
    """ONNX Runtime's own symmetric quantizer (the builder's), dequantized: w [out, in]."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rows, cols = w.shape
    blocks = cols // block
    packed = np.zeros((rows, blocks, block * bits // 8), np.uint8)
    scales = np.zeros((rows, blocks), np.float32)
    zero = np.zeros((rows, (blocks + 1) // 2), np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, np.ascontiguousarray(w.T), scales, zero, block, rows, cols, True)
    return _dequant(packed, scales, bits)


def _dequant(packed: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    rows, blocks, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], -1).reshape(rows, blocks, -1).astype(np.int32) - 8
    else:
        q = packed.astype(np.int32) - 128
    return (q * scales[..., None].astype(np.float64)).reshape(rows, -1)


def _correlated(n: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((width, width)) / np.sqrt(width) + np.eye(width)
    return rng.standard_normal((n, width)) @ mix * rng.uniform(0.2, 3.0, width)


@pytest.mark.parametrize("bits", [4, 8])
def test_rounded_weights_are_what_the_builders_quantizer_writes_and_beat_nearest(bits):
    from doel.export.gptq import round_matrix

    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    x = _correlated(512, 128)
    h = torch.from_numpy(x.T @ x / len(x))
    got = round_matrix(torch.from_numpy(w), h, bits, 64).numpy()
    np.testing.assert_allclose(_mlas(got, bits, 64), got, rtol=1e-6, atol=0)  # on the grid
    nearest = _mlas(w, bits, 64)

    def err(v):  # the layer's output error on the calibration inputs
        return float(np.sum((x @ (v - w).T) ** 2))

    assert err(got) < 0.8 * err(nearest)
    assert not np.array_equal(got, nearest)


def test_promoted_matrices_are_left_to_the_builder():
    from doel.export.gptq import promoted_layers, targets

    # onnxruntime-genai's mixed_layers for 30 layers (its rounding of n/8; the export's own
    # placement is checked against a built graph below)
    assert promoted_layers(30) == {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29}
    plan = targets(30, promoted_layers(30))
    assert "model.layers.0.self_attn.q_proj" not in plan
    assert "model.layers.0.mlp.down_proj" not in plan
    assert plan["model.layers.0.mlp.up_proj"] == "model.layers.0.mlp.gate_proj"
    assert plan["model.layers.4.self_attn.v_proj"] == "model.layers.4.self_attn.q_proj"
    assert len(targets(30, set())) == 30 * 7


def test_calibration_text_is_past_the_loss_checks(tiny_bundle):
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.parity import eval_texts

    ckpt = inspect_checkpoint(tiny_bundle.parent / "serve-ckpt")
    plain = eval_texts(ckpt, [], 256)
    both = eval_texts(ckpt, [], 256, rest_tokens=512)
    assert [t["docs"] for t in plain] == [t["docs"] for t in both]
    for t in both:
        assert t["rest"] and sum(map(len, t["rest"])) <= 256
        assert not any(r == d[: len(r)] for r in t["rest"] for d in t["docs"])


def _matrix(bundle, name: str) -> np.ndarray:
    m = onnx.load(str(bundle / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and name in n.name)
    bits = next(a.i for a in node.attribute if a.name == "bits")
    packed, scales = (numpy_helper.to_array(inits[i]) for i in node.input[1:3])
    return _dequant(packed, scales.reshape(packed.shape[:2]), bits)


def test_a_gptq_export_carries_the_rounded_weights_exactly(tiny_bundle, tmp_path):
    from safetensors.numpy import load_file

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.gptq import promoted_layers, rounded_checkpoint

    src = tiny_bundle.parent / "serve-ckpt"
    ckpt = inspect_checkpoint(src)
    windows = np.random.default_rng(0).integers(16, 2000, (2, 6, 64)).tolist()
    rounded = rounded_checkpoint(ckpt, tmp_path / "r", 4, 64, False, windows, log=lambda _m: None)
    weights = load_file(str(rounded / "model.safetensors"))
    quiet = {"eval_tokens": 64, "log": lambda _m: None, "promoted_bits": 0}
    export_checkpoint(rounded, tmp_path / "b", ExportOptions(quant="int4", **quiet))
    for i in range(2):
        w = weights[f"model.layers.{i}.self_attn.o_proj.weight"]
        np.testing.assert_allclose(_matrix(tmp_path / "b", f"layers.{i}/attn/o_proj"), w, rtol=1e-6)
    out = tmp_path / "g"
    mixed = quiet | {"promoted_bits": None}  # the table's: the builder's mixed placement
    m = export_checkpoint(src, out, ExportOptions(quant="int4", **mixed))  # int4's default
    assert m["quantization"]["rounding"] == "gptq" and not (out / ".gptq").exists()
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    finer = {
        int(n.name.split("layers.")[1].split("/")[0])
        for n in graph.graph.node
        if n.op_type == "MatMulNBits"
        and "qkv_proj" in n.name
        and next(a.i for a in n.attribute if a.name == "bits") == 8
    }
    assert finer == promoted_layers(2)
    loss = m["parity"]["loss"]
    assert loss["increase_nats_per_token"] <= loss["bound_nats_per_token"]


def test_without_text_to_spare_the_default_rounds_to_nearest_and_says_so():
    from doel.export.common import ExportError
    from doel.export.gptq import choose_rounding

    said = []
    assert choose_rounding(None, "int4", "genai", True, said.append) == "gptq" and not said
    assert choose_rounding(None, "int4", "genai", False, said.append) == "rtn"
    assert "no text" in said[-1]
    assert choose_rounding(None, "int4", "optimum", True, said.append) == "rtn"
    assert "builder" in said[-1]
    assert choose_rounding(None, "int8", "genai", True, said.append) == "rtn"
    assert choose_rounding("rtn", "int4", "genai", True, said.append) == "rtn"
    with pytest.raises(ExportError, match="--rounding gptq: no text is left"):
        choose_rounding("gptq", "int4", "genai", False, said.append)


def test_bad_requests_are_one_line_errors(tiny_bundle, tmp_path):
    from doel.export.bundle import ExportOptions
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.common import ExportError
    from doel.export.gptq import rounded_checkpoint

    with pytest.raises(ExportError, match="--rounding must be one of"):
        ExportOptions(rounding="awq")
    with pytest.raises(ExportError, match="--quant fp32 has none"):
        ExportOptions(quant="fp32", rounding="gptq")
    ckpt = inspect_checkpoint(tiny_bundle.parent / "serve-ckpt")
    with pytest.raises(ExportError, match="no text is left"):
        rounded_checkpoint(ckpt, tmp_path / "r", 4, 64, False, [[], []])


def test_a_head_at_the_bodys_bits_is_rounded_apart_from_the_tied_embedding(tiny_bundle, tmp_path):
    from safetensors.numpy import load_file

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.gptq import rounded_checkpoint

    src = tiny_bundle.parent / "serve-ckpt"
    emb = "model.embed_tokens.weight"
    before = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in before  # the tiny model ties its head to the embedding
    windows = np.random.default_rng(0).integers(16, 2000, (2, 6, 64)).tolist()
    args = (inspect_checkpoint(src), tmp_path / "r", 4, 64, False, windows)
    rounded = rounded_checkpoint(*args, log=lambda _m: None, head=True)
    after = load_file(str(rounded / "model.safetensors"))
    np.testing.assert_array_equal(after[emb], before[emb])
    head = after["lm_head.weight"]
    blocks = head.reshape(head.shape[0], -1, 64).astype(np.float64)
    steps = blocks / (np.abs(blocks).max(-1, keepdims=True) / 8)
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)  # on the 4-bit grid
    assert not np.allclose(head, before[emb])
    quiet = {"eval_tokens": 64, "promoted_bits": 0, "head_bits": 4}
    export_checkpoint(
        rounded, tmp_path / "b", ExportOptions(quant="int4", rounding="rtn", log=print, **quiet)
    )
    np.testing.assert_allclose(_matrix(tmp_path / "b", "lm_head"), head, rtol=1e-6)
    for head_bits, matrices in ((4, 15), (None, 14)):  # 2 layers x 7, and the head at 4 bits
        said: list[str] = []
        opts = ExportOptions(quant="int4", log=said.append, **(quiet | {"head_bits": head_bits}))
        export_checkpoint(src, tmp_path / f"h{head_bits}", opts)
        assert any(f"rounding {matrices} matrices with GPTQ" in m for m in said), said
