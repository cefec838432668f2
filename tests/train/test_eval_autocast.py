"""Evaluation under the run's autocast (issue 56, item 6): a run's task scoring and a CUDA
evaluation run in bfloat16, as training does; in float32, attention with grouped KV heads has
no fused SDPA kernel and silently takes the math one. A CPU evaluation stays in float32."""

from __future__ import annotations

import json

import pytest
import torch

from doel.train.evals.heldout import eval_autocast
from doel.train.fit import fit
from doel.train.model import Llama


@pytest.mark.slow  # a 2-step run
def test_a_runs_task_scoring_runs_under_its_autocast(
    monkeypatch, tmp_path, shards, tiny_run_config
):
    seen = []

    def spy(model, tok, items, device=None):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.5, "chance": 0.5, "items": 2}

    monkeypatch.setattr("doel.train.loop.task_accuracy", spy)
    piqa = tmp_path / "piqa"
    piqa.mkdir()
    row = {"goal": "To dry clothes,", "sol1": "hang them.", "sol2": "soak them."}
    (piqa / "valid.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    (piqa / "valid-labels.lst").write_text("0\n1\n")
    cfg = tiny_run_config("steps=2", "eval_every=2", f"eval_task=piqa={piqa}", "dtype=bfloat16")
    fit(cfg, shards, tmp_path / "run", log=lambda s: None, skip_verify=True)
    assert seen == [(True, torch.bfloat16)]


def test_eval_autocast_is_the_asked_dtype_and_float32_on_a_cpu_by_default(tiny_model_config):
    model = Llama(tiny_model_config)
    with eval_autocast(model, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    with eval_autocast(model, "bfloat16"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
