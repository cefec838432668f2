"""The prepared first GPU run runs end to end with --cpu (tiny, on this CPU), so its first run on
a rented GPU is not its first run (issue 56)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # spawns the benchmark, torchrun and its ranks
def test_the_first_gpu_hour_runs_every_part_on_the_cpu(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.train.gpu_first_hour", "--cpu", "--out", tmp_path]
    proc = subprocess.run(list(map(str, cmd)), cwd=ROOT, capture_output=True, text=True)
    (result,) = tmp_path.glob("gpu_first_hour_cpu_*.json")
    r = json.loads(result.read_text())
    failed = {k: v.get("error") for k, v in r["parts"].items() if not v["ok"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-2000:])
    parts = r["parts"]
    assert set(parts) == {
        "bench", "verify", "flash_step", "optimizer_step", "muon_lr_sweep", "ddp", "fsdp"
    }  # fmt: skip
    assert parts["bench"]["tokens_per_s"] > 0 and parts["bench"]["recompiles"] >= 0
    assert parts["verify"]["checks"]["resume"] == "pass"
    assert len(parts["muon_lr_sweep"]["final_train_loss"]) == 3
    for strategy in ("ddp", "fsdp"):
        assert parts[strategy]["resumed"] and parts[strategy]["resumed_equals_uninterrupted"]
    assert result.with_suffix(".md").is_file()
