"""The huge-page probe: each row's process gets its own switch, the rows take turns, a cell is
the best over processes, and the report's ratios are the rows' (issue 57)."""

from __future__ import annotations

import importlib
import json
import types


def _probe():
    return importlib.import_module("benchmarks.probes.probe_hugepages")


def _row(short_tok_s: float, long_tok_s: float, ttft: float, pss: float, huge: float) -> dict:
    return {
        "short": {"ttft_s": ttft, "decode_tok_s": short_tok_s},
        "long": {"ttft_s": ttft * 10, "decode_tok_s": long_tok_s},
        "pss_mb": pss,
        "anon_huge_mb": huge,
        "load_s": 0.5,
    }


def test_each_round_runs_one_doel_process_and_each_llama_row_with_its_environment(
    monkeypatch, tmp_path
):
    probe = _probe()
    calls = []
    speed = iter(range(100, 1000, 10))

    def fake_run(cmd, cwd, capture_output, text, env):
        spec = json.loads(cmd[-1])
        calls.append((spec["engine"], spec.get("first"), env.get("GLIBC_TUNABLES")))
        rows = probe.DOEL if spec["engine"] == "doel" else [None]
        got = {name: _row(next(speed), 50.0, 0.1, 300.0, 120.0) for name in rows}
        out = got if spec["engine"] == "doel" else got[None]
        return types.SimpleNamespace(returncode=0, stdout=json.dumps(out) + "\n", stderr="")

    monkeypatch.setattr(probe.subprocess, "run", fake_run)
    got = probe.measure_pair({"doel": tmp_path / "b", "llama": tmp_path / "m.gguf"}, [1, 2, 3])
    tunables = [probe.VARIANTS[name][1]["GLIBC_TUNABLES"] for name in probe.LLAMA]
    one_round = [("doel", probe.DOEL[0], None)] + [("llama", None, t) for t in tunables]
    assert calls[:3] == one_round
    assert calls[3][1] == probe.DOEL[1]  # the other doel row is built first in round 2
    assert len(calls) == 3 * probe.PROCESSES
    # speeds grow with each row measured: a row's best is its last round's
    rows = probe.PROCESSES * len(probe.VARIANTS)
    assert got["best"][probe.LLAMA[1]]["short"]["decode_tok_s"] == 100 + 10 * (rows - 1)
    assert all(len(rs) == probe.PROCESSES for rs in got["per_process"].values())


def test_a_doel_process_times_both_rows_and_builds_each_with_its_switch(tiny_bundle, monkeypatch):
    probe = _probe()
    monkeypatch.setattr(probe, "PROMPTS", {"short": 8, "long": 24})
    monkeypatch.setattr(probe, "REPEATS", {"short": 2, "long": 1})
    monkeypatch.setattr(probe, "NEW_TOKENS", 4)
    switches = []
    monkeypatch.setattr(probe.os.environ, "update", lambda env: switches.append(env[probe.SWITCH]))
    got = probe.doel_child(str(tiny_bundle), list(range(20, 60)), probe.DOEL[1])
    assert switches == ["0", "1"]  # the 4 KB row built first, as asked
    assert set(got) == set(probe.DOEL)
    for row in got.values():
        assert row["short"]["decode_tok_s"] > 0 and row["long"]["ttft_s"] > 0
        assert row["load_s"] > 0
    assert got[probe.DOEL[1]]["anon_huge_mb"] == 0


def test_the_report_gives_pages_and_llama_cpp_ratios():
    probe = _probe()
    on, off, plain, glibc = probe.VARIANTS
    best = {
        on: _row(220.0, 110.0, 0.10, 330.0, 120.0),
        off: _row(200.0, 100.0, 0.11, 300.0, 0.0),
        plain: _row(180.0, 100.0, 0.12, 400.0, 0.0),
        glibc: _row(189.0, 100.0, 0.12, 420.0, 98.0),
    }
    # each process's pair, 2 MB / 4 KB: 1.05, 0.90, 1.20 after 128; 0.95, 1.10, 0.90 after 1,536
    per_process = {
        on: [_row(210.0, 95.0, 0.1, 1, 1), _row(180.0, 110.0, 0.1, 1, 1), _row(240, 90, 0.1, 1, 1)],
        off: [
            _row(200.0, 100.0, 0.1, 1, 0),
            _row(200.0, 100.0, 0.1, 1, 0),
            _row(200, 100, 0.1, 1, 0),
        ],
    }
    r = {
        "date": "2026-12-07",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "X", "class": "amd-avx512-vnni", "isa": {"avx2": True}},
        "machine_load": "load average 0.1 at the end",
        "foreign_cpu_s": 0.2,
        "wall_s": 100.0,
        "thp": "always [madvise] never",
        "kernel": "6.18",
        "cells": {"smollm2-135m int4": {"best": best, "per_process": per_process}},
    }
    md = probe.markdown(r)
    pairs = "1.05 (2 of 3) / 0.95 (1 of 3)"
    assert (
        f"| smollm2-135m | int4 | 1.10 / 1.10 | {pairs} | 1.10 / 1.10 | 1.10 | 1.05 / 1.00 |" in md
    )
    assert f"| smollm2-135m | q4_0 | {glibc} | 189.0 / 100.0 |" in md
