"""Data parallelism on CPU with gloo: 2 processes under torchrun against 1, for DDP and FSDP2
(tied weights checked under the wrapper); a sharded FSDP checkpoint resumed at another world
size; elastic restart after kill -9; a hung rank stops the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from doel.train.checkpoint import latest_checkpoint
from doel.train.data.loader import TokenLoader
from doel.train.metrics import read_metrics

pytestmark = pytest.mark.slow  # every test here spawns torchrun and its ranks
ROOT = Path(__file__).resolve().parents[2]
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
# A constant schedule, so that a run's step count does not change its first steps' lr.
FLAT = ["log_every=1", "schedule=constant", "warmup_steps=0", "eval_every=0"]


STEPS = 36  # "a few dozen": float drift between world sizes has room to show


def fit_cmd(shards, out, nproc, *sets, steps=STEPS, every=12, restarts=None):
    args = ["fit", "--config", "tiny", "--data", str(shards), "--out", str(out)]
    args += ["--steps", str(steps), "--checkpoint-every", str(every)]
    for s in (*FLAT, *sets):
        args += ["--set", s]
    if nproc == 1:
        return [sys.executable, "-m", "doel.train", *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += [f"--nproc_per_node={nproc}"]
    if restarts is not None:
        launcher += [f"--max-restarts={restarts}"]
    return [*launcher, "-m", "doel.train", *args]


def run(cmd) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def losses(run_dir) -> list[float]:
    return [
        r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"
    ]


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def assert_same_model(a, b, tol=5e-4):
    """The same weights within float tolerance. Ranks sum gradients in another order than one
    process, and Adam divides each step by the gradient's running RMS: an element whose
    gradient is near zero steps by about lr (3e-3) whatever its size, so that noise moves a few
    elements by a fraction of a step. After 36 steps under FSDP: at most 1.2e-4 for an element,
    1.4e-4 of a tensor's norm (DDP: under 1e-5); a real defect moves whole tensors."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert float((wa[k] - wb[k]).abs().max()) < tol, k
        assert float((wa[k] - wb[k]).norm() / wb[k].norm()) < tol, k


def test_ranks_split_the_global_batch_with_no_overlap_and_no_gap(shards):
    single = TokenLoader(shards, batch_size=6, seq_len=32, seed=3)
    ranks = [
        TokenLoader(shards, batch_size=2, seq_len=32, seed=3, rank=r, world_size=3)
        for r in range(3)
    ]
    for _ in range(40):  # across an epoch boundary too
        x, y = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert (x == torch.cat([torch.from_numpy(p[0]) for p in parts]).numpy()).all()
        assert (y == torch.cat([torch.from_numpy(p[1]) for p in parts]).numpy()).all()
    # The position is global: any rank's state resumes the single stream (and vice versa).
    assert all(loader.state_dict() == single.state_dict() for loader in ranks)


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> Path:
    """One process, global batch 4, STEPS steps."""
    out = tmp_path_factory.mktemp("ref")
    run(fit_cmd(shards, out, 1, "batch_size=4"))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(shards, reference, tmp_path, strategy):
    proc = run(fit_cmd(shards, tmp_path, 2, "batch_size=2", f"strategy={strategy}"))
    assert "2 ranks" in proc.stdout and "tok/s (global)" in proc.stdout
    assert "pass gradient_flow" in proc.stdout  # the gate and the suite, under the wrapper
    assert proc.stdout.count("pass gradient_flow") == 1  # rank 0 logs alone
    # The tie under the wrapper: one tensor before and after a backward, and its (averaged,
    # whole) gradient is the sum of the embedding's and the head's, rebuilt on each rank.
    rows = json.loads((tmp_path / "verify" / "verify.json").read_text())["checks"]
    ties = next(r for r in rows if r["name"] == "ties")
    assert ties["status"] == "pass" and ties["numbers"]["ranks"] == 2, ties
    parts = ties["numbers"]["model.embed_tokens.weight"]
    assert parts["error_vs_sum"] < 1e-5
    assert parts["input_side_share"] > 0.01 and parts["output_side_share"] > 0.01
    assert losses(tmp_path) == pytest.approx(losses(reference), rel=1e-4)
    assert_same_model(tmp_path, reference)
    final = weights(tmp_path)
    assert "lm_head.weight" not in final  # the tie survived sharding: the head is stored once


MUON_STEPS = 3


def muon_cmd(shards, out, nproc, *sets, steps=MUON_STEPS):
    cmd = fit_cmd(shards, out, nproc, "optimizer=muon", *sets, steps=steps, every=steps)
    return [*cmd, "--skip-verify"]


def test_muon_under_ddp_and_fsdp_matches_one_process(shards, tmp_path):
    """Two ranks of 2 rows match one process that accumulates the same two micro-batches
    (batch_size=2, grad_accum=2) bit for bit, under DDP and FSDP alike: micro-batch r of the
    one process is rank r's slice of the global batch (the loader test above), each micro-batch
    runs the same kernels on the same shapes, and averaging two gradients is exact whichever
    way it is done (one process: g1/n + g2/n; DDP and FSDP: (2·g1/n + 2·g2/n) / 2, a sum of two
    and halvings). FSDP gathers each matrix's update and orthogonalizes it whole, so it also
    equals DDP's (torch's Muon on whole matrices), for the model's wide, tall and square ones.

    One process with batch_size=4 is the looser second statement (losses over the 3 steps,
    weights after one): it sums each matrix's gradient over 4 rows in one product, in another
    order (~1e-7), and torch's Muon runs Newton-Schulz in bfloat16, which turns that into a
    visible difference of the update (one step: 2.7e-4 for an element, 0.3 % of a tensor's
    norm, o_proj, small at init, on an Intel AMX host), above assert_same_model's 5e-4. Later
    steps compound it by CPU: after 3, 9.3e-4 and 1.2 % on an AMD AVX-512 host, 2.2e-3 and
    2.7 % on the Intel one. A wrong sharded update moves whole matrices from the first step."""
    run(muon_cmd(shards, tmp_path / "accum", 1, "batch_size=2", "grad_accum=2"))
    run(muon_cmd(shards, tmp_path / "accum1", 1, "batch_size=2", "grad_accum=2", steps=1))
    run(muon_cmd(shards, tmp_path / "one", 1, "batch_size=4"))
    run(muon_cmd(shards, tmp_path / "one1", 1, "batch_size=4", steps=1))
    for strategy in ("ddp", "fsdp"):
        proc = run(muon_cmd(shards, tmp_path / strategy, 2, "batch_size=2", f"strategy={strategy}"))
        assert "optimizer group muon: 14 tensors" in proc.stdout
    accum = weights(tmp_path / "accum")
    for strategy in ("ddp", "fsdp"):
        assert losses(tmp_path / strategy) == losses(tmp_path / "accum"), strategy
        got = weights(tmp_path / strategy)
        assert got.keys() == accum.keys()
        assert all(torch.equal(got[k], accum[k]) for k in accum), strategy
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    accum1, one = weights(tmp_path / "accum1"), weights(tmp_path / "one1")
    for k in one:
        assert float((accum1[k] - one[k]).abs().max()) < 2e-3, k
        assert float((accum1[k] - one[k]).norm() / one[k].norm()) < 2e-2, k


def torchrun_workers(nproc: int, job: str, out: Path, *args) -> list[dict]:
    """tests/train/dist_workers.py JOB OUT ARGS under torchrun; each rank's report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", str(ROOT / "tests" / "train" / "dist_workers.py")]
    run([*cmd, job, str(out), *args])
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_muon_equals_one_process_with_two_collectives_a_shape(tmp_path, world):
    """FSDP2's row shards of 17 matrices in 6 shapes (counts of 1 to 5: at world 2 and 3 some
    are not multiples of the world; 65 rows split unevenly; at world 3 the 2-row matrices leave
    rank 2 without rows) against torch.optim.Muon on the whole matrices: the same weights and
    momentum bit for bit after each of 3 steps, with one all_to_all to the owners and one back
    per shape an update, nothing else (a per-matrix gather would count 17 or more)."""
    reports = torchrun_workers(world, "muon", tmp_path)
    for rep in reports:
        assert rep["world"] == world and rep["shapes"] == 6
        for step in rep["steps"]:
            assert step["sharded"] and step["all_moved"]
            assert all(step["weights_equal"]), (rep["rank"], step["max_error"])
            assert all(step["momentum_equal"]), rep["rank"]
            assert step["collectives"] == {"c10d.alltoall_base_": 2 * 6}
    if world == 3:
        assert 0 in reports[2]["steps"][0]["rows_here"]  # a rank without rows of a matrix


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_blocks_are_compiled_before_sharding_and_train_as_eager(tmp_path, strategy):
    """build_parts with compile under 2 ranks: each block had its compiled forward when
    fully_shard (or DDP) took it, one block graph served both layers with FSDP's hooks outside
    it (its inputs are the whole, gathered weights), and 2 steps give eager's losses and
    weights (aot_eager backend: see tests/train/dist_workers.py)."""
    reports = torchrun_workers(2, "compile", tmp_path, strategy)
    hidden, layers = 64, 2  # configs/tiny.toml
    for rep in reports:
        assert rep["step_calls"] == "BlocksCompiled"
        wrappers = [w["wrapper"] for w in rep["wrapping"]]
        assert wrappers == (["block"] * layers + ["root"] if strategy == "fsdp" else ["root"])
        assert all(all(w["blocks_compiled"]) for w in rep["wrapping"])
        assert rep["graphs_after_warmup"] == 1 and len(rep["graphs"]) == 1
        assert rep["graphs"][0][0] == [2, 64, hidden] and [hidden, hidden] in rep["graphs"][0]
        compiled, eager = rep["losses"]["True"], rep["losses"]["False"]
        assert compiled[1] < compiled[0]  # it trained
        assert compiled == pytest.approx(eager, rel=1e-6)
        assert rep["max_weight_error"] < 1e-6


@pytest.fixture(scope="module")
def sharded_run(shards, tmp_path_factory) -> Path:
    """2 FSDP processes, 12 of STEPS steps: the checkpoint at step 12 is sharded."""
    out = tmp_path_factory.mktemp("fsdp-12")
    run(fit_cmd(shards, out, 2, "batch_size=2", "strategy=fsdp", steps=12))
    return out


def test_an_fsdp_checkpoint_is_sharded_safetensors_and_loads_in_transformers(sharded_run):
    from transformers import LlamaForCausalLM

    ckpt = latest_checkpoint(sharded_run)
    assert ckpt.name == "step-000012"
    shards = sorted(p.name for p in (ckpt / "sharded").iterdir())
    assert shards == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    assert not (ckpt / "optimizer.safetensors").exists()  # no full optimizer gathered
    # No pickles: every file is safetensors, JSON or the model card (DCP's .metadata is not).
    kinds = {p.suffix for p in ckpt.rglob("*") if p.is_file()}
    assert kinds <= {".safetensors", ".json", ".md"}, kinds
    pieces = [load_file(str(ckpt / "sharded" / name)) for name in shards]
    head = "optim.state.model.embed_tokens.weight.exp_avg"
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    assert all(p[head].shape[0] == vocab // 2 for p in pieces)  # each rank wrote its half
    full = load_file(str(ckpt / "model.safetensors"))
    halves = [p["model.model.embed_tokens.weight"] for p in pieces]
    assert torch.equal(torch.cat(halves), full["model.embed_tokens.weight"])
    hf = LlamaForCausalLM.from_pretrained(ckpt)
    assert torch.equal(hf.lm_head.weight, full["model.embed_tokens.weight"])
    assert torch.equal(
        hf.model.layers[1].mlp.down_proj.weight, full["model.layers.1.mlp.down_proj.weight"]
    )


@pytest.mark.parametrize("resume_nproc", [1, 2])
def test_fsdp_checkpoint_resumes_at_another_world_size(
    sharded_run, shards, reference, tmp_path, resume_nproc
):
    shutil.copytree(sharded_run, tmp_path, dirs_exist_ok=True)
    batch = 4 // resume_nproc
    proc = run(fit_cmd(shards, tmp_path, resume_nproc, f"batch_size={batch}", "strategy=fsdp"))
    assert "resuming from" in proc.stdout and "step 12" in proc.stdout
    assert losses(tmp_path) == pytest.approx(losses(reference), rel=1e-4)
    assert_same_model(tmp_path, reference)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_elastic_restart_after_kill_9_gives_the_uninterrupted_weights(shards, tmp_path):
    slow = [
        "batch_size=2",
        "model.hidden_size=192",
        "model.num_hidden_layers=4",
        "seq_len=128",
        "model.num_attention_heads=6",
    ]
    run(fit_cmd(shards, tmp_path / "whole", 2, *slow, steps=24, every=4))
    job = tmp_path / "killed"
    proc = subprocess.Popen(
        fit_cmd(shards, job, 2, *slow, steps=24, every=4, restarts=2),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 180
    while latest_checkpoint(job) is None and time.time() < deadline:
        time.sleep(0.05)
    workers = [c for agent in _children(proc.pid) for c in [agent, *_children(agent)]]
    workers = [w for w in workers if w != proc.pid]
    assert workers, "no worker processes found to kill"
    os.kill(workers[-1], signal.SIGKILL)  # one rank dies mid-run, no human steps in
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resuming from" in out
    wa, wb = weights(tmp_path / "whole"), weights(job)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ranks_minutes_apart_before_step_1_wait_the_setup_timeout(shards, tmp_path):
    """Rank 1 reaches the checks 8 s after rank 0, past dist_timeout=3 but within
    dist_setup_timeout=60: the run finishes (issue 56, item 8)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "tests" / "train" / "dist_hang.py"),
        "slow-setup",
        str(ROOT / "configs" / "tiny.toml"),
        str(shards),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_a_hung_rank_ends_the_job_with_a_timeout_naming_it(shards, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "tests" / "train" / "dist_hang.py"),
        str(ROOT / "configs" / "tiny.toml"),
        str(shards),
        str(tmp_path),
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "rank 0: a collective did not complete within 5 s" in text, text[-3000:]
    assert "rank 1 last began step 3; the others are at step 4" in text
    assert time.time() - t0 < 200
