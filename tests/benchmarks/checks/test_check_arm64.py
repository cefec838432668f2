"""The ARM64 check's comparison (benchmarks/checks/check_arm64.py), on made-up results: the
emulated run itself takes minutes under qemu, so CI runs only this logic (the measured table
is committed in benchmarks/results/arm64_*.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.checks.check_arm64 import BOUNDS, compare, first_divergence, window_stats

VOCAB = 16


def _side(greedy, prompt_ids=((5, 6), (7,)), margin=0.5):
    return {
        "prompt_ids": [list(p) for p in prompt_ids],
        "greedy": [list(g) for g in greedy],
        "margins": [[margin] * len(g) for g in greedy],
    }


def test_first_divergence_names_the_prompt_and_position():
    ref = [[1, 2, 3], [4, 5, 6]]
    assert first_divergence(ref, [[1, 2, 3], [4, 5, 6]]) is None
    assert first_divergence(ref, [[1, 2, 3], [4, 9, 6]]) == (1, 1)
    assert first_divergence(ref, [[1, 2, 9], [4, 9, 6]]) == (0, 2)  # the first one
    assert first_divergence(ref, [[1, 2], [4, 5, 6]]) == (0, 2)  # a run that stopped early


def test_window_stats_top1_diff_and_loss():
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 9).tolist()]
    ref = rng.normal(size=(2, 9, VOCAB)).astype(np.float32)
    same = window_stats(ref, ref.copy(), windows)
    assert same["top1_agreement"] == 1.0 and same["max_abs_diff"] == 0.0
    assert same["loss_increase"] == 0.0 and same["positions"] == 18

    got = ref.copy()
    top = int(got[1, 4].argmax())
    got[1, 4, top] -= 100.0  # one position's top-1 moves elsewhere
    moved = window_stats(ref, got, windows)
    assert moved["top1_agreement"] == pytest.approx(17 / 18)
    assert moved["max_abs_diff"] == pytest.approx(100.0)
    assert moved["max_rel_diff"] == pytest.approx(100.0 / np.abs(ref).max())
    runner_up = np.sort(ref[1, 4])[-2]
    assert moved["flip_max_gap"] == pytest.approx(ref[1, 4, top] - runner_up)
    assert same["flip_max_gap"] == 0.0

    # Uniform logits score log(V) a token; logits sure of every target score ~0: the loss
    # falls by log(V), over the positions that have a next token only.
    flat = np.zeros((2, 9, VOCAB), np.float32)
    sure = flat.copy()
    for w, ids in enumerate(windows):
        sure[w, np.arange(8), ids[1:]] = 50.0
    stats = window_stats(flat, sure, windows)
    assert stats["loss_ref"] == pytest.approx(np.log(VOCAB))
    assert stats["loss_increase"] == pytest.approx(-np.log(VOCAB), abs=1e-6)


def test_compare_passes_equal_runs_and_names_each_failure():
    good = {"top1_agreement": 1.0, "max_rel_diff": 1e-3, "loss_increase": 1e-5}
    ref = _side([[1, 2, 3], [4, 5, 6]])
    assert compare(ref, _side([[1, 2, 3], [4, 5, 6]]), good) == []

    (msg,) = compare(ref, _side([[1, 2, 3], [4, 5, 7]]), good)
    assert "prompt 1's position 2" in msg and "margin there 0.5" in msg

    bad = {
        "top1_agreement": BOUNDS["top1_agreement"] - 0.01,
        "max_rel_diff": BOUNDS["max_rel_diff"] * 2,
        "loss_increase": BOUNDS["loss_increase"] * 2,
    }
    other_ids = _side([[1, 2, 3], [4, 5, 6]], prompt_ids=((5, 6), (8,)))
    failures = compare(ref, other_ids, bad)
    assert len(failures) == 4
    assert failures[0] == "the tokenizer gives other ids"
    assert [f.split()[0] for f in failures[1:]] == ["top-1", "max", "loss"]
    # At the bounds themselves it passes: they are the largest difference allowed.
    edge = {k: BOUNDS[k] for k in ("top1_agreement", "max_rel_diff", "loss_increase")}
    assert compare(ref, _side([[1, 2, 3], [4, 5, 6]]), edge) == []


def test_the_worker_decodes_as_serving_does(tiny_bundle, tmp_path):
    """Each side's worker on x86 (the tiny fp32 bundle): its greedy ids are serve's at
    temperature 0, its window logits the engine's, and a run compared with itself passes."""
    from benchmarks.checks.check_arm64 import make_job, work
    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams

    text = Path(__file__).resolve().parents[3] / "train" / "sample" / "bn.txt"
    job = make_job(tiny_bundle, [text], ("model.onnx",), ("বাংলা ভাষা", "The river"), 6, 24)
    out = work(job, tmp_path)
    assert out["prompt_ids"] == job["prompt_ids"] and len(job["windows"][0]) == 24
    engine = Engine(read_bundle(tiny_bundle), threads=1)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    greedy = out["models"]["model.onnx"]["greedy"]
    assert greedy == [list(engine.generate(ids, params)) for ids in job["prompt_ids"]]
    logits = np.load(tmp_path / "model.onnx.npy")
    assert logits.shape == (1, 24, read_bundle(tiny_bundle).vocab_size)
    np.testing.assert_allclose(logits[0], engine.forward(job["windows"][0], 0, every=True))
    stats = window_stats(logits, logits.copy(), job["windows"])
    side = {"prompt_ids": out["prompt_ids"], **out["models"]["model.onnx"]}
    assert compare(side, side, stats) == [] and stats["top1_agreement"] == 1.0
