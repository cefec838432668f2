"""The GPU benchmark script runs end to end (on the CPU here, with the tiny preset)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # spawns the benchmark script
def test_gpu_benchmark_script_reports_mfu_and_the_gate(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.train.bench_gpu",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--verify",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (result,) = tmp_path.glob("gpu_tiny_cpu_*.json")
    r = json.loads(result.read_text())
    assert r["gate_ok"] and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5
    assert r["verify_ok"] and list(tmp_path.glob("verify_tiny_cpu_*/verify.md"))
    assert r["backward_over_forward"] > 0 and (tmp_path / result.name).with_suffix(".md").is_file()
