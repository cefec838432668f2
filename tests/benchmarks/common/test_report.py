"""A result is written whole beside its Markdown: the one writer."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench(name: str = "serve.bench_serve"):
    """A script of benchmarks/ as the module `benchmarks.NAME` (the package the root holds)."""
    return importlib.import_module(f"benchmarks.{name}")


def test_a_benchmark_result_is_written_whole_beside_its_markdown(tmp_path, monkeypatch):
    """Both files land in a folder made for them; a write that fails leaves the last result."""
    from benchmarks.common.report import publish

    md = publish(tmp_path / "results", "x_cpu-amd-avx2", {"ratio": 2.5}, "# x\n", echo=False)
    assert md.read_text() == "# x\n"
    assert json.loads((tmp_path / "results" / "x_cpu-amd-avx2.json").read_text()) == {"ratio": 2.5}

    def full(*_a, **_k):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="no space"):
        publish(tmp_path / "results", "x_cpu-amd-avx2", {"ratio": 9.9}, "# y\n", echo=False)
    assert md.read_text() == "# x\n"
    assert sorted(p.name for p in md.parent.iterdir()) == [
        "x_cpu-amd-avx2.json",
        "x_cpu-amd-avx2.md",
    ]
