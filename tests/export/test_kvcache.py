"""The int8 KV cache at export (export/kvcache.py): each channel's scale covers what calibration
saw (keys: every rotation of their rotary pair), the graph quantizes what GroupQueryAttention
writes with those scales, and the bundle serves logits close to the fp32 cache's."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper


def test_key_scales_cover_every_rotation_of_their_rotary_pair():
    from doel.export.kvcache import SCALE_FLOOR, kv_scales

    top = np.array([[3.0, 0.0, 4.0, 1.0]], np.float32)  # one KV head of 4 channels
    got = kv_scales({"past_key_values.0.key": top, "past_key_values.0.value": top})
    # halves: channels 0 and 2 rotate into each other, and 1 and 3
    want_key = np.array([5.0, 1.0, 5.0, 1.0]) / 127
    np.testing.assert_allclose(got["past_key_values.0.key"][:, 0], [want_key], rtol=1e-6)
    # values do not rotate: each channel its own, and a silent one the floor
    want_value = np.maximum(top / 127, SCALE_FLOOR)
    np.testing.assert_allclose(got["past_key_values.0.value"][:, 0], want_value, rtol=1e-6)
    assert got["past_key_values.0.key"].shape == (1, 1, 4)
    interleaved = kv_scales({"past_key_values.0.key": top}, interleaved=True)
    want = np.array([3, 3, 17**0.5, 17**0.5]) / 127  # pairs (0, 1) and (2, 3)
    np.testing.assert_allclose(interleaved["past_key_values.0.key"][0, 0], want, rtol=1e-6)


def test_a_graph_without_attention_nodes_is_left_alone(tmp_path):
    from doel.export.kvcache import int8_kv_cache

    path = tmp_path / "model.onnx"
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], [])), str(path))
    before = path.read_bytes()
    assert int8_kv_cache(path, {}) is False and path.read_bytes() == before


def test_a_page_for_the_browser_is_not_made_with_an_int8_cache():
    from doel.export.bundle import ExportOptions
    from doel.export.common import ExportError

    with pytest.raises(ExportError, match="--web with --kv-cache int8"):
        ExportOptions(kv_cache="int8", web=True)
    assert ExportOptions(kv_cache="int8").kv_cache == "int8"


def _scales(bundle) -> dict[str, np.ndarray]:
    """{past name: scale [kv_heads, 1, head_dim]} as the graph holds them."""
    m = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    out = {}
    for node in m.graph.node:
        if node.op_type == "GroupQueryAttention":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["kv_cache_bit_width"] == 8
            assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
            for past, scale in ((node.input[3], node.input[12]), (node.input[4], node.input[13])):
                out[past] = numpy_helper.to_array(inits[scale])
    return out


@pytest.fixture(scope="module")
def bundles(tiny_bundle, tmp_path_factory):
    from doel.export.bundle import ExportOptions, export_checkpoint

    ckpt, out = tiny_bundle.parent / "serve-ckpt", tmp_path_factory.mktemp("kv")
    for kv in ("fp32", "int8"):
        opts = ExportOptions(quant="int4", kv_cache=kv, eval_tokens=256, log=lambda _m: None)
        export_checkpoint(ckpt, out / kv, opts)
    return out / "fp32", out / "int8"


def test_the_int8_cache_holds_the_fp32_cache_quantized_by_its_scales(bundles):
    from doel.serve.core.engine import Engine, read_bundle

    plain, quantized = bundles
    manifest = json.loads((quantized / "manifest.json").read_text())
    assert manifest["kv_cache"]["dtype"] == "int8"
    assert manifest["parity"]["loss"]["increase_nats_per_token"] < 0.10  # int4's bound
    scales = _scales(quantized)
    assert len(scales) == 2 * manifest["kv_cache"]["layers"]
    ids = np.random.default_rng(0).integers(16, 2000, 40).tolist()
    engines = [Engine(read_bundle(b), threads=2) for b in (plain, quantized)]
    logits = [e.forward(ids, 0, every=True) for e in engines]
    names = engines[1].past_names
    for name, exact, held in zip(names, engines[0].kv_arrays, engines[1].kv_arrays):
        assert held.dtype == np.int8
        scale = scales[name][None]  # [1, kv_heads, 1, head_dim]
        # The same layer's input differs a little (earlier layers read an int8 cache), so
        # compare against the fp32 entries quantized with the graph's scales, saturating.
        want = np.clip(np.rint(exact[:, :, : len(ids)] / scale), -128, 127)
        off = np.abs(held[:, :, : len(ids)].astype(np.int32) - want)
        assert np.mean(off <= 1) > 0.99, name
        assert (held[:, :, len(ids) :] == 0).all()  # nothing written past the prompt
    rel = np.abs(logits[1] - logits[0]).max() / np.abs(logits[0]).max()
    assert 0 < rel < 0.05
