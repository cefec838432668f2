"""Issue 57's int8-cache lever, engine-level: the probe times both caches' steps in one process,
scores both on the same windows, and reports each cell against fp32 (– past a context)."""

from __future__ import annotations

import importlib

import numpy as np


def _probe():
    return importlib.import_module("benchmarks.probes.probe_kv_int8")


def test_the_loss_is_each_next_ids_negative_log_likelihood():
    probe = _probe()
    logits = np.zeros((4, 10), np.float32)  # uniform over 10 ids
    logits[1, 7] = 5.0  # position 1 is sure of id 7
    total, picks = probe._nll(logits, [0, 3, 7, 2])
    sure = np.log(9 + np.exp(5.0)) - 5.0
    assert abs(total - (2 * np.log(10) + sure)) < 1e-9
    assert picks[1] == 7 and len(picks) == 3


def test_one_process_times_and_scores_both_caches(tiny_bundle, tmp_path, monkeypatch):
    from doel.export.bundle import ExportOptions, export_checkpoint

    probe = _probe()
    ckpt, paths = tiny_bundle.parent / "serve-ckpt", {}
    for cache in probe.CACHES:
        opts = ExportOptions(quant="int4", kv_cache=cache, eval_tokens=64, log=lambda _m: None)
        export_checkpoint(ckpt, tmp_path / cache, opts)
        paths[cache] = str(tmp_path / cache)
    windows = [list(range(20, 52)), list(range(60, 92))]
    monkeypatch.setattr(probe, "held_out", lambda _tok: windows)
    small = {"CONTEXTS": (8, 40, 10_000), "STEPS": 3, "ROUNDS": 2, "ROWS": 2, "PROMPTS": (16,)}
    small["ROWS_AT"] = 20
    for name, value in small.items():
        monkeypatch.setattr(probe, name, value)
    got = probe.child(paths, with_loss=True)
    # 10,000 positions are past the text (64 ids): that context is not timed
    cells = ("8", "40", "rows", "prefill 16")
    assert set(got["ms"]) == {f"{c} {n}" for c in probe.CACHES for n in cells}
    assert all(v > 0 for v in got["ms"].values())
    assert got["tokens"] == 62
    nll = got["nats_per_token"]
    assert 0 < nll["fp32"] and abs(nll["int8"] - nll["fp32"]) < 0.1 * nll["fp32"]
    assert 0.5 < got["top1_agreement"] <= 1


def test_the_report_gives_each_cell_against_fp32():
    probe = _probe()
    ms = {"fp32 128": 10.0, "int8 128": 8.0, "fp32 rows": 20.0, "int8 rows": 22.0}
    cell = {"ms": ms, "nats_per_token": {"fp32": 2.5, "int8": 2.51}, "top1_agreement": 0.93}
    r = {
        "date": "2026-12-06",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "X", "class": "amd-avx512-vnni", "isa": {"avx2": True}},
        "machine_load": "load average 0.1 at the end",
        "foreign_cpu_s": 0.2,
        "wall_s": 100.0,
        "cells": {"0.4b int4": cell},
    }
    md = probe.markdown(r)
    cells = "10.00 / 8.00 (0.80) | – | – | 20.00 / 22.00 (1.10) | – | –"
    assert f"| 0.4b | int4 | {cells} |" in md
    assert "| 0.4b | int4 | 2.5000 | 2.5100 | +0.0100 | 0.930 |" in md
