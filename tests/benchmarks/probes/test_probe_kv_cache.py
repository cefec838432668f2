"""Issue 57's int8-KV-cache lever: the probe's quantized caches, each type's attention against
fp32 on the same cache, and the report it writes."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

TINY = {"heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 3}


def _probe():
    return importlib.import_module("benchmarks.probes.probe_kv_cache")


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_int8_cache_rounds_each_value_within_half_a_step(per_channel):
    probe = _probe()
    x = probe.cache_values(TINY, buffer=32)["k"]
    q, scale = probe.quantize(x, per_channel)
    assert q.dtype == np.int8 and q.shape == x.shape
    assert scale.shape == ((2, 1, 16) if per_channel else (1,))
    back = q.astype(np.float32) * (scale[None] if per_channel else scale)
    assert np.abs(back - x).max() <= (scale.max() / 2) * 1.0001
    assert np.abs(q).max() == 127  # the largest value takes the whole range


def test_each_cache_type_attends_as_fp32_does_within_its_rounding():
    probe = _probe()
    out = probe.measure_model(TINY, caches=(8, 24), calls=2, rounds=1, buffer=32)
    assert set(out) == set(probe.TYPES)
    assert out["fp32"]["error"][24] == 0.0 and out["fp32"]["us"][8] > 0
    assert out["fp16"]["error"][24] < 1e-2
    assert out["fp32"]["writes_only_its_entry"] and out["fp16"]["writes_only_its_entry"]
    int8 = {k: v for k, v in out.items() if k.startswith("int8") and "error_text" not in v}
    if not int8:
        pytest.skip("this ONNX Runtime has no int8 cache in GroupQueryAttention")
    for t in int8.values():
        assert 0 < t["error"][24] < 0.1  # int8 rounding: visible, a few percent at most
        assert t["writes_only_its_entry"]
    # one scale per channel follows the channels' spread: never worse than one for the tensor
    assert out["int8 per channel"]["error"][24] <= out["int8 per tensor"]["error"][24] * 1.5


def test_a_cache_type_the_runtime_refuses_is_recorded_not_raised(monkeypatch):
    probe = _probe()
    monkeypatch.setattr(probe, "TYPES", ("fp32", "int4"))  # no such type: graph() raises
    real = probe.graph

    def graph(kind, s, buffer=probe.BUFFER):
        if kind == "int4":
            raise RuntimeError("NOT_IMPLEMENTED: int4\nmore")
        return real(kind, s, buffer)

    monkeypatch.setattr(probe, "graph", graph)
    out = probe.measure_model(TINY, caches=(8,), calls=1, rounds=1, buffer=16)
    assert out["int4"] == {"error_text": "NOT_IMPLEMENTED: int4"} and out["fp32"]["us"][8] > 0


def test_the_report_gives_each_type_against_fp32_and_a_token_over_the_layers():
    probe = _probe()
    types = {
        "fp32": {"us": {"128": 40.0, "1536": 300.0}, "error": {"128": 0.0, "1536": 0.0}},
        "int8 per tensor": {"us": {"128": 30.0, "1536": 600.0}, "error": {"1536": 0.03}}
        | {"writes_only_its_entry": False},
        "fp16": {"error_text": "refused"},
    }
    r = {
        "date": "2026-12-06",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "X", "class": "amd-avx512-vnni", "isa": {"avx2": True}},
        "load_start": 0.3,
        "machine_load": "load average 0.5 at the end (2 cores)",
        "threads": 2,
        "buffer": 2048,
        "caches": [128, 1536],
        "calls": 200,
        "rounds": 7,
        "shapes": {"smollm2-135m": probe.SMOLLM2},
        "flash": {"0": {"models": {"smollm2-135m": types}, "foreign_cpu_s": 0.4}},
    }
    text = probe.markdown(json.loads(json.dumps(r)))
    assert "| fp32 | 40.0 | 1.00 | 1.20 | 300.0 | 1.00 | 9.00 | 0.0e+00 | yes |" in text
    assert (
        "| int8 per tensor | 30.0 | 0.75 | 0.90 | 600.0 | 2.00 | 18.00 | 3.0e-02 | **no** |" in text
    )
    assert "| fp16 | not run: refused |" in text
    assert "heads 9/3, head 64, 30 layers" in text
    assert "| error at 1536 | other entries of the cache kept |" in text
