"""Which torch build `make demo` installs (.ci/torch_build.py, issue 38 point 2): the CUDA build
with an NVIDIA GPU, a CPU build without one, said in one line; CI's pinned CPU wheel is kept."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "torch_build.py"
spec = importlib.util.spec_from_file_location("torch_build", SCRIPT)
tb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tb)


def fake_smi(folder: Path, output: str, code: int = 0) -> Path:
    """An nvidia-smi on PATH that prints `output` and exits with `code`."""
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'X'\n{output}\nX\nexit {code}\n")
    smi.chmod(0o755)
    return folder


def test_a_gpu_listed_by_nvidia_smi_gets_the_cuda_build(tmp_path, monkeypatch):
    line = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path / 'bin', line)}:{os.environ['PATH']}")
    assert tb.gpu_name() == "GPU 0: NVIDIA H100 80GB HBM3"
    extra, said = tb.choose(tb.gpu_name(), "linux", "2.14.1")
    assert extra is None and said.startswith("torch: the CUDA build") and "H100" in said


def test_no_gpu_means_a_cpu_build(tmp_path, monkeypatch):
    broken = fake_smi(tmp_path / "bin", "NVIDIA-SMI has failed: no driver", code=9)
    monkeypatch.setenv("PATH", f"{broken}:/usr/bin:/bin")
    assert tb.gpu_name() is None  # nvidia-smi without a driver or GPU is no GPU
    assert tb.gpu_name(which=lambda _: None) is None
    # pip would take PyPI's CUDA build, and no CPU wheel lies on disk: PyTorch's CPU index
    extra, said = tb.choose(None, "linux", "2.14.1", None)
    assert extra == ["--index-url", tb.CPU_INDEX, tb.SPEC] and "CPU build" in said
    # a CPU wheel on this machine's disk: pinned to it
    extra, said = tb.choose(None, "linux", "2.14.1", "2.13.0+cpu")
    assert extra == ["torch==2.13.0+cpu"] and "2.13.0+cpu" in said and "disk" in said
    # CI: PIP_CONSTRAINT pins the CPU wheel, so pip's own choice is left alone
    assert tb.choose(None, "linux", "2.13.0+cpu", None)[0] is None
    assert tb.choose(None, "darwin", None)[0] is None  # PyPI's macOS torch has no CUDA
    for _, said in (tb.choose(None, "linux", "2.14.1"), tb.choose("GPU 0: X", "linux", None)):
        assert "\n" not in said and said.startswith("torch")


def test_the_script_says_its_choice_in_one_line_and_make_uses_it(tmp_path):
    fake = fake_smi(tmp_path / "bin", "GPU 0: NVIDIA A10G (UUID: GPU-1)")
    env = os.environ | {"PATH": f"{fake}:{os.environ['PATH']}"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.splitlines() == [
        "torch: the CUDA build (PyPI's), for the NVIDIA GPU found (GPU 0: NVIDIA A10G)"
    ]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("$(BIN)/.installed-demo:", "$(BIN)/.installed:"):
        recipe = makefile.split(target, 1)[1].split("\n\n", 1)[0]
        assert "$(BIN)/python .ci/torch_build.py" in recipe
        assert recipe.index("torch_build.py") < recipe.index("pip install -e")
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI's command is unchanged
