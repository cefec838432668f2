"""The ONNX Runtime options probe keeps each option's best and slowest process."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench(name: str = "serve.bench_serve"):
    """A script of benchmarks/ as the module `benchmarks.NAME` (the package the root holds)."""
    return importlib.import_module(f"benchmarks.{name}")


def test_ort_options_probe_keeps_each_options_best_and_slowest_process():
    """The best figure of each kind over the processes (the least disturbed), the slowest beside
    it, and a ceiling that is the ratio of the two throughputs it prints."""
    probe = _bench("probes.probe_ort_options")
    runs = [
        {"prefill_ms": 100.0, "step1_ms": 6.0, "step8_ms": 20.0, "foreign_cpu_s": 0.1, "wall_s": 9},
        {"prefill_ms": 90.0, "step1_ms": 7.0, "step8_ms": 18.0, "foreign_cpu_s": 0.3, "wall_s": 9},
    ]
    r = probe.best_of(runs)
    assert (r["prefill_ms"], r["step1_ms"], r["step8_ms"]) == (90.0, 6.0, 18.0)
    assert (r["prefill_ms_worst"], r["step1_ms_worst"], r["step8_ms_worst"]) == (100.0, 7.0, 20.0)
    assert r["foreign_cpu_s"] == 0.3 and r["processes"] == 2 and not r["busy"]
    one, eight = probe.stream_tok_s(90.0, 6.0, 18.0)
    assert one == pytest.approx(128 / (90 + 127 * 6) * 1e3)
    assert eight / one == pytest.approx(r["ratio_ceiling"])
    row = r | {"quant": "int4", "option": "LUT GEMM", "max_logit_diff": 0.0}
    cpu = {"model_name": "CPU", "class": "x86", "isa": {}}
    text = probe.markdown(
        {"cpu": cpu, "date": "d", "machine": "m", "onnxruntime": "1", "rows": [row]}
    )
    cells = f"| 90 | 6.00 | 18.00 | {r['ratio_ceiling']:.2f} |"
    assert f"| int4 | LUT GEMM | `mlas.use_lut_gemm=1` {cells}" in text
    assert "| 100 / 7.00 / 20.00 |" in text
