"""The accuracy_level probe changes only the attribute and times steps."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench(name: str = "serve.bench_serve"):
    """A script of benchmarks/ as the module `benchmarks.NAME` (the package the root holds)."""
    return importlib.import_module(f"benchmarks.{name}")


def _accuracy_levels(model: Path) -> set[int]:
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return {
        a.i
        for n in graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "accuracy_level"
    }


@pytest.mark.slow  # exports the tiny model at int4
def test_accuracy_level_probe_changes_only_the_attribute_and_times_steps(
    tiny_bundle, tmp_path, monkeypatch
):
    probe = _bench("probes.probe_accuracy_level")

    from doel.export.bundle import ExportOptions, export_checkpoint

    opts = ExportOptions(quant="int4", eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", tmp_path / "int4", opts)
    folder = probe.variant(tmp_path / "int4", 1, tmp_path / "level1")
    assert _accuracy_levels(folder / "model.onnx") == {1}
    assert _accuracy_levels(tmp_path / "int4" / "model.onnx") == {4}  # the bundle untouched
    assert (folder / "manifest.json").read_bytes() == (
        tmp_path / "int4" / "manifest.json"
    ).read_bytes()
    monkeypatch.setattr(probe, "PROMPT", 8)
    monkeypatch.setattr(probe, "STEPS", 2)
    fp32, int8 = probe.measure(folder), probe.measure(tmp_path / "int4")
    assert fp32["step1_ms"] > 0 and fp32["step8_ms"] > 0 and fp32["logits"].shape[0] == 1
    # Same weights: only the activations' rounding differs.
    scale = np.abs(int8["logits"]).max()
    assert np.abs(fp32["logits"] - int8["logits"]).max() < 0.1 * scale
    with pytest.raises(SystemExit, match="no MatMulNBits"):
        probe.variant(tiny_bundle, 1, tmp_path / "fp32-level1")  # fp32: nothing to change
