"""The checks before step 1 sized for one GPU that holds the run (issue 56, item 2): the checks
that train fresh models (step, resume) take vcfg.fresh_rows rows of each micro-batch, not the
run's whole micro-batch (16 x 2048 at 0.4B: two more models at that size would not fit), and
the copy task's learning rate shrinks with depth and width."""

from __future__ import annotations

import dataclasses

from doel.train.checks.base import VerifyConfig
from doel.train.checks.causal import copy_lr
from doel.train.checks.suite import run_suite
from doel.train.config import load_config, resolve_config
from doel.train.model import Llama
from doel.train.settings import TrainConfig


def test_step_and_resume_train_fresh_models_on_fresh_rows(shards, tiny_config):
    rows_seen = []

    class Recording(Llama):
        def forward(self, idx, *a, **kw):
            rows_seen.append(idx.size(0))
            return super().forward(idx, *a, **kw)

    cfg = tiny_config("batch_size=8", "grad_accum=2", "seq_len=32")
    report = run_suite(
        cfg,
        shards,
        checks=["step", "resume"],
        model_factory=lambda c: Recording(c.model),
        vcfg=VerifyConfig(fresh_rows=2),
        log=lambda s: None,
    )
    assert report.ok, report.format()
    # step: 1 pass; resume: 4 steps x 2 micro-batches, twice (whole and resumed)
    assert len(rows_seen) == 1 + 2 * 4 * 2
    assert set(rows_seen) == {2}, f"fresh models saw micro-batches of {sorted(set(rows_seen))}"


def test_the_copy_task_lr_is_the_tiny_one_on_tiny_and_smaller_at_0_4b(tiny_config):
    tiny = tiny_config()
    assert copy_lr(tiny, VerifyConfig()) == min(1e-2, 3 * tiny.lr)  # calibrated there
    big = load_config(TrainConfig, resolve_config("bangla-0.4b"), [])
    assert copy_lr(big, VerifyConfig()) <= big.lr  # 24 layers of 1024: not 3 x the run's lr
    assert copy_lr(big, VerifyConfig(copy_lr=5e-3)) == 5e-3  # an explicit value is kept
    deeper = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, num_hidden_layers=8))
    assert copy_lr(deeper, VerifyConfig()) < copy_lr(tiny, VerifyConfig())
