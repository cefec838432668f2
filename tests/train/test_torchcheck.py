"""The torch floor (pyproject's train extra and train/torchcheck.py agree, an older torch is
refused in one line) and the CUDA-unavailable message naming the likely cause (issue 56, 1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from doel.train.common import DoelError
from doel.train.dist import resolve_device
from doel.train.torchcheck import MIN_TORCH, cuda_missing_reason, too_old

ROOT = Path(__file__).resolve().parents[2]


def test_the_train_extra_names_the_floor_the_code_needs():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    train = text[text.index("train = [") :]
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', train[: train.index("]")])
    assert (int(floor[1]), int(floor[2])) == MIN_TORCH
    assert MIN_TORCH >= (2, 9)  # torch.optim.Muon first shipped in 2.9
    assert hasattr(torch.optim, "Muon")


@pytest.mark.parametrize("version", ["2.4.1", "2.8.0+cu128", "1.13.1"])
def test_an_older_torch_is_refused_in_one_line_naming_the_floor(version):
    msg = too_old(version)
    assert msg and "\n" not in msg
    assert version in msg and "torch>=2.9" in msg and "Muon" in msg


@pytest.mark.parametrize("version", ["2.9.0", "2.10.0a0+git1234", "3.0.0"])
def test_the_floor_and_newer_pass(version):
    assert too_old(version) is None


@pytest.mark.slow  # a child interpreter
def test_doel_train_fit_over_torch_2_8_exits_with_the_one_line(tmp_path):
    """The real CLI path, in a child whose torch claims 2.8: one line, no traceback."""
    code = (
        "import sys, torch; torch.__version__ = '2.8.0+cu128'\n"
        "from doel.train.cli import main\n"
        f"main(['fit', '--config', 'tiny', '--data', {str(tmp_path)!r}, '--out', "
        f"{str(tmp_path / 'run')!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "torch 2.8.0+cu128 is too old" in out.stderr and "torch>=2.9" in out.stderr


def test_the_cuda_message_names_the_likely_cause():
    cpu = cuda_missing_reason(None, "2.9.0+cpu", None)
    assert "CPU-only build" in cpu and "whl/cu" in cpu
    driver = cuda_missing_reason("12.8", "2.9.0+cu128", "535.104.05")
    assert "CUDA 12.8" in driver and "535.104.05" in driver and "driver" in driver
    none = cuda_missing_reason("12.8", "2.9.0+cu128", None)
    assert "nvidia-smi not found" in none


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_asking_for_cuda_without_one_is_refused_naming_the_wheel(monkeypatch):
    with pytest.raises(DoelError, match="device=cuda but torch sees no CUDA GPU") as e:
        resolve_device("cuda")
    assert torch.__version__ in str(e.value)
    # A machine with a driver torch cannot use: auto refuses rather than train on the CPU.
    monkeypatch.setattr("doel.train.dist.nvidia_driver", lambda: "535.104.05")
    with pytest.raises(DoelError, match="device=cpu to train on the CPU anyway"):
        resolve_device("auto")
    monkeypatch.setattr("doel.train.dist.nvidia_driver", lambda: None)
    assert resolve_device("auto").type == "cpu"
