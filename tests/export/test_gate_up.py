"""gate|up as one MatMulNBits at export (export/gate_up.py): the default int4 and int8 bundles
hold one matrix of 2N rows a layer and a Split, serve the logits of the unfused export, and say
so in the manifest; DOEL_EXPORT_GATE_UP=0 leaves the builder's two matrices."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest


def _export(ckpt, out, quant, monkeypatch, fused: bool):
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.gate_up import ENV

    monkeypatch.setenv(ENV, "1" if fused else "0")
    export_checkpoint(ckpt, out, ExportOptions(quant=quant, eval_tokens=64, log=lambda _m: None))
    return out


def _ops(bundle):
    m = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    return [n.op_type for n in m.graph.node], [n.name for n in m.graph.node]


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_the_fused_export_serves_the_unfused_logits(tiny_bundle, tmp_path, quant, monkeypatch):
    from doel.serve.core.engine import Engine, read_bundle

    ckpt = tiny_bundle.parent / "serve-ckpt"
    fused = _export(ckpt, tmp_path / "fused", quant, monkeypatch, fused=True)
    plain = _export(ckpt, tmp_path / "plain", quant, monkeypatch, fused=False)
    layers = json.loads((fused / "config.json").read_text())["num_hidden_layers"]
    ops, names = _ops(fused)
    ops_plain, names_plain = _ops(plain)
    assert ops.count("Split") == layers and ops_plain.count("Split") == 0
    assert ops_plain.count("MatMulNBits") - ops.count("MatMulNBits") == layers
    assert sum("gate_up_proj" in n for n in names) == 2 * layers  # MatMulNBits and its Split
    assert not any("gate_up_proj" in n for n in names_plain)
    q = {b: json.loads((b / "manifest.json").read_text())["quantization"] for b in (fused, plain)}
    assert q[fused]["gate_up_fused"] == layers and q[plain]["gate_up_fused"] == 0
    ids = np.random.default_rng(0).integers(16, 2000, 20).tolist()
    got = {}
    for b in (fused, plain):
        e = Engine(read_bundle(b), threads=2)
        got[b] = np.concatenate([e.forward(ids, 0, every=True), e.forward([5], 20)[None]])
    np.testing.assert_allclose(got[fused], got[plain], rtol=0, atol=1e-5)


def test_fusing_twice_changes_nothing_and_an_unfused_graph_has_no_halves(tmp_path):
    from doel.export import gate_up

    m = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))
    assert gate_up.pairs(m.graph) == [] and gate_up.fuse_gate_up(m) == 0
    assert gate_up.halves(m.graph) == {}
    path = tmp_path / "model.onnx"
    onnx.save(m, str(path))
    assert gate_up.fuse_model_file(path) == 0


def test_the_switch_reads_the_environment(monkeypatch):
    from doel.export import gate_up

    monkeypatch.delenv(gate_up.ENV, raising=False)
    assert gate_up.enabled()
    monkeypatch.setenv(gate_up.ENV, "0")
    assert not gate_up.enabled()
