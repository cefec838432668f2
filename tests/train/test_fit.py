"""Whole runs of the tiny preset: the run folder, exact resume (also after a real kill -9),
non-finite loss handling, atomic checkpoints, the plot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from doel.train.checkpoint import latest_checkpoint, list_checkpoints
from doel.train.fit import fit
from doel.train.loop import NonFiniteLossError
from doel.train.metrics import read_metrics
from doel.train.plot import plot_run

pytestmark = pytest.mark.slow  # every test here trains a run (tens of seconds on 2 cores)
ROOT = Path(__file__).resolve().parents[2]


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))


def train_losses(run_dir) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"])
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "train"
    ]


class Killed(Exception):
    pass


def test_a_run_writes_an_hf_folder_and_resumes_bit_identically(tmp_path, shards, tiny_run_config):
    cfg = tiny_run_config("steps=8", "checkpoint_every=4", "eval_every=4")
    whole = fit(cfg, shards, tmp_path / "whole", log=lambda s: None)
    card = (whole / "README.md").read_text()  # the model card, HF metadata block first
    assert card.startswith("---\nlanguage:") and "| steps | 8 |" in card
    assert (tmp_path / "whole" / "checkpoints" / "step-000004" / "README.md").is_file()
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in whole.iterdir()
    }

    def killer(line):  # dies while logging step 6: the step-4 checkpoint is the last one
        if line.startswith("step      6/"):
            raise Killed

    with pytest.raises(Killed):
        fit(cfg, shards, tmp_path / "resumed", log=killer)
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000004"
    lines = []
    resumed = fit(cfg, shards, tmp_path / "resumed", log=lines.append)
    assert any("resuming from" in line and "step 4" in line for line in lines)
    a, b = weights(whole), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "resumed")
    assert [s for s, _ in train_losses(tmp_path / "resumed")] == list(range(1, 9))


def test_keeps_the_last_k_checkpoints_and_ignores_half_written_ones(
    tmp_path, shards, tiny_run_config
):
    run = tmp_path / "run"
    fit(
        tiny_run_config("steps=6", "checkpoint_every=1", "keep_checkpoints=2"),
        shards,
        run,
        log=lambda s: 0,
    )
    assert [p.name for p in list_checkpoints(run)] == ["step-000005", "step-000006"]
    # A save killed before its rename leaves only a hidden temporary folder: never resumed from.
    (run / "checkpoints" / ".tmp-step-000007-123").mkdir()
    assert latest_checkpoint(run).name == "step-000006"
    state = json.loads((run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["loader"]["cursor"] > 0
    assert state["config"]["model"]["hidden_size"] == 64


def test_fresh_starts_over(tmp_path, shards, tiny_run_config):
    run = tmp_path / "run"
    fit(tiny_run_config("steps=2", "checkpoint_every=2"), shards, run, log=lambda s: 0)
    lines = []
    fit(tiny_run_config("steps=2", "checkpoint_every=2"), shards, run, fresh=True, log=lines.append)
    assert not any("resuming" in line for line in lines)
    assert [s for s, _ in train_losses(run)] == [1, 2]


def test_a_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path, shards, tiny_run_config
):
    run = tmp_path / "run"
    # lr 1e38 makes the first update overflow float32: the step-2 loss is NaN.
    cfg = tiny_run_config(
        "steps=6", "checkpoint_every=1", "lr=1e38", "grad_clip=0", "warmup_steps=0"
    )
    # The suite would refuse these settings before step 1 (its optimizer-parity row overflows
    # too); skipped here so that the run reaches the NaN it must stop at.
    with pytest.raises(NonFiniteLossError, match="step 2") as err:
        fit(cfg, shards, run, log=lambda s: 0, skip_verify=True)
    assert "step-000001" in str(err.value)
    assert [p.name for p in list_checkpoints(run)] == ["step-000001"]
    assert not (run / "final").exists()


def test_plot_draws_the_curves(tmp_path, shards, tiny_run_config):
    run = tmp_path / "run"
    fit(tiny_run_config("steps=4", "eval_every=2"), shards, run, log=lambda s: 0)
    png = plot_run(run)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _fit_cmd(shards, out, *sets):
    args = [sys.executable, "-m", "doel.train", "fit", "--config", "tiny", "--data", str(shards)]
    args += ["--out", str(out), "--steps", "16", "--checkpoint-every", "4", "--skip-verify"]
    # A model big enough that steps take a noticeable time, so the kill lands mid-run.
    for s in ("model.hidden_size=256", "model.num_hidden_layers=4", "seq_len=128", *sets):
        args += ["--set", s]
    return args


@pytest.mark.slow  # spawns the training processes
def test_kill_9_mid_run_then_rerun_gives_the_uninterrupted_weights(tmp_path, shards):
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    subprocess.run(
        _fit_cmd(shards, tmp_path / "whole"), check=True, env=env, capture_output=True, cwd=ROOT
    )
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _fit_cmd(shards, killed),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while latest_checkpoint(killed) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "final").exists()
    rerun = subprocess.run(
        _fit_cmd(shards, killed), env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming from" in rerun.stdout
    a, b = weights(tmp_path / "whole" / "final"), weights(killed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


# Dynamo reads `.grad` of a block's input, a non-leaf activation, and hides torch's warning about
# it with a display filter, which pytest's filterwarnings=error turns into an exception.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_compiled_run_gates_the_compiled_model_and_matches_eager(
    tmp_path, shards, tiny_run_config
):
    lines = []
    fit(tiny_run_config("steps=3", "compile=true"), shards, tmp_path / "compiled", log=lines.append)
    if any("torch.compile failed" in line for line in lines):
        pytest.skip("no working inductor toolchain here: the run fell back to eager, loudly")
    assert any("pass gradient_flow" in line for line in lines)
    fit(tiny_run_config("steps=3"), shards, tmp_path / "eager", log=lambda s: 0)
    compiled, eager = train_losses(tmp_path / "compiled"), train_losses(tmp_path / "eager")
    assert [s for s, _ in compiled] == [1, 2, 3]
    for (_, a), (_, b) in zip(compiled, eager):
        assert a == pytest.approx(b, rel=1e-4)


def test_validation_can_score_a_multiple_choice_task(tmp_path, shards, tiny_run_config):
    piqa = tmp_path / "piqa"
    piqa.mkdir()
    rows = [
        {
            "goal": f"To dry wet clothes number {i},",
            "sol1": "hang them in the sun.",
            "sol2": "put them in the river.",
        }
        for i in range(12)
    ]
    (piqa / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (piqa / "valid-labels.lst").write_text("0\n1\n" * 6)
    lines = []
    cfg = tiny_run_config("steps=4", "eval_every=2", f"eval_task=piqa={piqa}", "eval_task_limit=10")
    fit(cfg, shards, tmp_path / "run", log=lines.append)
    tasks = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "task"]
    assert [r["step"] for r in tasks] == [2, 4]
    assert all(r["items"] == 10 and 0 <= r["acc"] <= 1 and r["chance"] == 0.5 for r in tasks)
    assert any(line.startswith("piqa at step 4: acc") for line in lines)


def test_every_checkpoint_carries_a_tokenizer_of_exactly_the_models_vocab_size(
    tmp_path, shards, tiny_run_config, sample_paths
):
    from tokenizers import Tokenizer

    from doel.train.common import DoelError
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    # A model larger than the shards' tokenizer (2,048) is refused before anything is written.
    with pytest.raises(DoelError, match=r"has 2048 tokens but model.vocab_size is 4096; .*=2048"):
        fit(tiny_run_config("model.vocab_size=4096"), shards, tmp_path / "big", log=lambda s: None)
    assert not (tmp_path / "big").exists()
    # So is a tokenizer of the right size that did not make the shards.
    other = train_tokenizer(
        resolve_sources(sample_paths[:1]),
        TokenizerConfig(vocab_size=2048),
        tmp_path / "tok",
        progress=False,
        log=lambda s: None,
    )
    with pytest.raises(DoelError, match="different tokenizer"):
        fit(
            tiny_run_config("steps=2"),
            shards,
            tmp_path / "other",
            tokenizer=other,
            log=lambda s: None,
        )
    final = fit(
        tiny_run_config("steps=2", "checkpoint_every=1"), shards, tmp_path / "run", log=lambda s: 0
    )
    folders = [final, *list_checkpoints(tmp_path / "run")]
    assert len(folders) == 3
    for folder in folders:
        size = json.loads((folder / "config.json").read_text())["vocab_size"]
        assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == size == 2048


def test_a_muon_run_resumes_bit_identically(tmp_path, shards, tiny_run_config):
    cfg = tiny_run_config("optimizer=muon", "steps=8", "checkpoint_every=4", "eval_every=0")
    lines = []
    # The suite's Muon rows are tested in test_checks.py: skipped here to keep this short.
    whole = fit(cfg, shards, tmp_path / "whole", log=lines.append, skip_verify=True)
    assert any(line.startswith("optimizer group muon: 14 tensors") for line in lines)

    def killer(line):  # dies while logging step 6: the step-4 checkpoint is the last one
        if line.startswith("step      6/"):
            raise Killed

    with pytest.raises(Killed):
        fit(cfg, shards, tmp_path / "resumed", log=killer, skip_verify=True)
    state = load_file(str(latest_checkpoint(tmp_path / "resumed") / "optimizer.safetensors"))
    assert "state.model.layers.1.mlp.up_proj.weight.momentum_buffer" in state  # Muon's
    assert "state.model.embed_tokens.weight.exp_avg_sq" in state  # AdamW's
    resumed = fit(cfg, shards, tmp_path / "resumed", log=lambda s: None, skip_verify=True)
    a, b = weights(whole), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "resumed")


def test_a_batch_ramp_keeps_the_steps_and_resumes_bit_identically(
    tmp_path, shards, tiny_run_config
):
    # Steps 1-6 make 2 updates of 2 rows each, steps 7-8 one of 4: the kill at step 6 resumes
    # from the step-4 checkpoint inside the ramp and crosses its end.
    ramp = ("batch_size=2", "grad_accum=2", "batch_ramp_fraction=0.75", "optimizer=muon")
    cfg = tiny_run_config(*ramp, "steps=8", "checkpoint_every=4", "eval_every=0")
    lines = []
    whole = fit(cfg, shards, tmp_path / "whole", log=lines.append, skip_verify=True)
    assert any(
        line.startswith("step      6/8") and "12 updates (2 rows each)" in line for line in lines
    )
    assert any(
        line.startswith("step      7/8") and "13 updates (4 rows each)" in line for line in lines
    )

    def killer(line):  # dies while logging step 6: the step-4 checkpoint is the last one
        if line.startswith("step      6/"):
            raise Killed

    with pytest.raises(Killed):
        fit(cfg, shards, tmp_path / "resumed", log=killer, skip_verify=True)
    resumed = fit(cfg, shards, tmp_path / "resumed", log=lambda s: None, skip_verify=True)
    a, b = weights(whole), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(tmp_path / "whole") == train_losses(tmp_path / "resumed")
    rows = [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["updates"] for r in rows] == [2, 4, 6, 8, 10, 12, 13, 14]
    assert [r["tokens"] for r in rows] == [r["step"] * 4 * 64 for r in rows]  # same tokens a step
