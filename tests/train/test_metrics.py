"""train/metrics.py: a device's peak is printed in a unit that shows it (a CPU's tens of
GFLOP/s are not "0.0 TFLOP/s"), with where it comes from, or as unknown."""

from __future__ import annotations

import pytest
import torch

import doel.train.metrics as metrics
from doel.train.build import describe
from doel.train.dist import DistInfo
from doel.train.model import Llama


@pytest.mark.parametrize(
    "flops, text",
    [
        (4.32e10, "43.2 GFLOP/s"),
        (9.0e11, "900 GFLOP/s"),
        (989e12, "989 TFLOP/s"),
        (1.2e15, "1.2 PFLOP/s"),
        (5.5e8, "550 MFLOP/s"),
        (None, "unknown"),
        (float("nan"), "unknown"),
    ],
)
def test_flops_keep_their_figures(flops, text):
    assert metrics.format_flops(flops) == text


def test_the_fit_header_prints_a_cpu_peak_with_its_dtype_never_zero(tiny_config, monkeypatch):
    cfg = tiny_config()
    model = Llama(cfg.model)
    # A CPU without fast bf16 matmuls measures tens of GFLOP/s: it printed "peak 0.0 TFLOP/s".
    monkeypatch.setattr(metrics, "cpu_peak_flops", lambda dtype: 4.32e10)
    lines = []
    desc = describe(model, cfg, torch.device("cpu"), torch.bfloat16, DistInfo(), lines.append)
    assert desc["peak_flops"] == 4.32e10
    assert "; peak 43.2 GFLOP/s (CPU, measured torch.bfloat16 matmul on " in lines[1]
    assert "threads)" in lines[1] and "0.0" not in lines[1].split("peak")[1]
    lines.clear()
    describe(model, cfg, torch.device("meta"), torch.float32, DistInfo(), lines.append)
    assert "; peak unknown (meta: unknown peak)" in lines[1]


def test_a_measured_cpu_peak_is_a_positive_figure():
    peak = metrics.cpu_peak_flops.__wrapped__(torch.float32, n=128)  # not the cached 2048 one
    assert peak > 1e6 and metrics.format_flops(peak)[0] != "0"
