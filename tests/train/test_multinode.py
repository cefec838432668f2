"""Two nodes on one machine: two torchrun agents started apart (--nnodes=2 --nproc-per-node=1,
c10d rendezvous on 127.0.0.1, gloo), each in a working folder of its own and both writing one
run folder, as machines with a shared file system would. They train what one process trains
when it accumulates the same micro-batches, bit for bit, under DDP and FSDP2; a worker killed
with -9 brings both agents back from the last checkpoint to the uninterrupted weights; and a
run folder each node holds on its own is refused at the start.
(The recipe on several nodes and its launch files: tests/pipeline/test_recipe_nodes.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
STEPS, EVERY = 8, 4
# A constant schedule, no validation: the steps alone decide the weights.
SETS = ["log_every=1", "schedule=constant", "warmup_steps=0", "eval_every=0"]
SETS += [f"steps={STEPS}", f"checkpoint_every={EVERY}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(tmp_path: Path, program: list[str], restarts: int = 0) -> list[subprocess.Popen]:
    """Two agents, as two machines would start them: the same rendezvous, nothing else shared
    but the run folder (absolute) and the shards."""
    port, nodes = free_port(), []
    for n in range(2):
        cwd = tmp_path / f"node{n}"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={port}"]
        cmd += [f"--max-restarts={restarts}", *program]
        nodes.append(subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    return nodes


def finish(nodes: list[subprocess.Popen], ok: bool = True) -> list[str]:
    outs = [p.communicate(timeout=120) for p in nodes]
    texts = [out + err for out, err in outs]
    if ok:
        assert all(p.returncode == 0 for p in nodes), "\n".join(t[-3000:] for t in texts)
    return texts


def fit_args(shards, out, *sets: str) -> list[str]:
    args = ["-m", "doel.train", "fit", "--config", str(TINY), "--data", str(shards)]
    args += ["--out", str(out), "--skip-verify"]
    for s in (*SETS, *sets):
        args += ["--set", s]
    return args


def weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def assert_equal_weights(a, b) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [
        k for k in wa if not torch.equal(wa[k], wb[k])
    ]


@pytest.fixture(scope="module")
def accumulated(shards, tmp_path_factory):
    """One process, micro-batches of 2 rows, two of them a step: what two nodes of one rank
    each, 2 rows a rank, must equal. A run a set of extra settings, made when first asked."""
    runs = {}

    def run(*sets: str) -> Path:
        if sets not in runs:
            out = tmp_path_factory.mktemp("accumulated")
            cmd = [sys.executable, *fit_args(shards, out, "batch_size=2", "grad_accum=2", *sets)]
            proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[sets] = out
        return runs[sets]

    return run


# FSDP clips by a norm it sums shard by shard, in another order than one process: when the
# clip bites, the coefficient differs in its last bit (2e-7 on a weight after 8 steps). DDP
# clips the whole, all-reduced gradient as one process does; FSDP is compared unclipped.
STRATEGIES = {"ddp": (), "fsdp": ("grad_clip=0",)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_nodes_train_what_one_process_accumulates_bit_for_bit(
    shards, accumulated, tmp_path, strategy
):
    extra = STRATEGIES[strategy]
    out = tmp_path / "run"
    program = fit_args(shards, out, "batch_size=2", f"strategy={strategy}", *extra)
    texts = finish(start_nodes(tmp_path, program))
    assert sum("2 ranks" in t for t in texts) == 1  # rank 0 alone logs, on one of the nodes
    assert not any((tmp_path / f"node{n}" / "run").exists() for n in (0, 1))
    assert_equal_weights(out, accumulated(*extra))


@pytest.mark.slow
def test_a_killed_worker_brings_both_nodes_back_to_the_uninterrupted_weights(
    shards, accumulated, tmp_path
):
    """torchrun's own elastic restart (--max-restarts=1) is enough here: the other agent's
    worker fails on the dead peer, both agents meet again in a new rendezvous round, and the
    ranks resume from the checkpoint at step 4."""
    out, pid_file = tmp_path / "run", tmp_path / "paused.pid"
    program = [str(ROOT / "tests" / "train" / "dist_hang.py"), "pause", str(pid_file), str(TINY)]
    program += [str(shards), str(out), *SETS, "batch_size=2", "strategy=ddp"]
    nodes = start_nodes(tmp_path, program, restarts=1)
    deadline = time.time() + 60
    while not pid_file.is_file() and time.time() < deadline and nodes[0].poll() is None:
        time.sleep(0.05)
    time.sleep(0.1)  # the PID is written before the file is closed
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # rank 1, paused after step 5
    texts = finish(nodes)
    assert sum("resuming from" in t and "step-000004" in t for t in texts) == 1, texts[0][-2000:]
    assert_equal_weights(out, accumulated())


@pytest.mark.slow
def test_a_run_folder_each_node_holds_alone_is_refused_at_the_start(shards, tmp_path):
    """A relative --out: each node would write its own folder under its own working folder."""
    texts = finish(start_nodes(tmp_path, fit_args(shards, "run", "batch_size=2")), ok=False)
    lines = [ln for t in texts for ln in t.splitlines() if "cannot see the run folder" in ln]
    assert lines and all("rank 1 on " in ln and "partial checkpoint" in ln for ln in lines)
    assert not any((tmp_path / f"node{n}" / "run" / "checkpoints").exists() for n in (0, 1))
