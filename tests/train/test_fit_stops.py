"""A run says when and why it stopped, and a resume of an unchanged run does not repeat the
checks before step 1 (issue 15, point 10: the demo stopped at its time limit silently, and its
checks took most of a rerun)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from doel.train.fit import fit


class Killed(Exception):
    pass


def test_a_run_stopped_by_its_time_limit_says_so_and_a_finished_one_too(
    tmp_path, shards, tiny_run_config
):
    lines = []
    quick = {"log": lines.append, "skip_verify": True}  # the checks are not the point here
    fit(tiny_run_config("steps=50", "time_limit=1e-9"), shards, tmp_path / "run", **quick)
    said = [line for line in lines if line.startswith("stopped early")]
    assert len(said) == 1 and "step 1 of 50" in said[0] and "time_limit" in said[0]
    assert not any(line.startswith("finished:") for line in lines)

    lines.clear()
    fit(tiny_run_config("steps=2"), shards, tmp_path / "done", **quick)
    assert any(line.startswith("finished: 2 steps") for line in lines)
    assert not any(line.startswith("stopped early") for line in lines)


def test_rerunning_a_finished_run_changes_nothing_and_says_so(tmp_path, shards, tiny_run_config):
    cfg = tiny_run_config("steps=3", "checkpoint_every=3")
    final = fit(cfg, shards, tmp_path / "run", log=lambda s: None, skip_verify=True)
    before = load_file(str(final / "model.safetensors"))
    lines = []
    final = fit(cfg, shards, tmp_path / "run", log=lines.append, skip_verify=True)
    after = load_file(str(final / "model.safetensors"))
    assert any(line.startswith("nothing to train") for line in lines)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow  # three runs with the checks before step 1
def test_a_resume_of_an_unchanged_run_skips_the_checks_but_not_the_gate(
    tmp_path, shards, tiny_run_config
):
    cfg = tiny_run_config("steps=6", "checkpoint_every=2")

    def killer(line):
        if line.startswith("step      3/"):
            raise Killed

    first = []
    with pytest.raises(Killed):
        fit(cfg, shards, tmp_path / "run", log=lambda s: (first.append(s), killer(s)))
    assert any(line.startswith("verifying before step 1") for line in first)

    lines = []
    fit(cfg, shards, tmp_path / "run", log=lines.append)
    assert any("not repeated on resume" in line for line in lines)
    assert not any(line.startswith("verifying before step 1") for line in lines)
    assert any("every one has a finite, nonzero gradient" in line for line in lines)  # the gate

    # A changed run (here: another learning rate) is checked again.
    lines.clear()
    fit(
        tiny_run_config("steps=6", "checkpoint_every=2", "lr=2e-3"),
        shards,
        tmp_path / "run",
        log=lines.append,
    )
    assert any(line.startswith("verifying before step 1") for line in lines)
    assert not any("not repeated on resume" in line for line in lines)
