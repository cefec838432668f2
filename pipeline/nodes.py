"""The recipe on several machines: which stages each node runs, and how training spans them.

Every node runs the same `doel recipe --nodes N --node-rank R --master-addr HOST` (the SLURM
and SkyPilot files in recipes/bangla-0.4b/ do). The first node (rank 0) runs every stage; only
training spans the nodes, one torchrun agent a node meeting in a c10d rendezvous at HOST. The
data, tokenizer, shards, verify, eval, sft and export stages run once, on the first node, so
the other nodes would only repeat or race them. Those nodes run the train stage alone: they
wait until the first node starts training (it writes RUN/stages/train.launch.json, with the
stage's fingerprint and a fresh rendezvous id, and removes it when training ends), then start
their agent for that rendezvous. RUN must therefore be one folder every node mounts at the
same path (fit refuses a run folder the nodes do not share: train/dist.py).

With --nodes N and no --node-rank, the N agents all start on this machine on 127.0.0.1, each
in a working folder of its own (RUN/nodes/node-K): the multi-node path, tried on a laptop
(`doel recipe --dry-run --nodes 2`) before it is paid for.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from doel.contracts import read_json
from doel.train.common import DoelError, atomic_write_json

LAUNCH = "train.launch.json"  # in RUN/stages: the first node's training, while it runs


@dataclass(frozen=True)
class Nodes:
    """The machines of one job: `count` nodes, this one `rank` (None: all of them here)."""

    count: int = 1
    rank: int | None = None
    master_addr: str = "127.0.0.1"  # where the first node's agent hosts the rendezvous
    port: int = 29400

    def __post_init__(self):
        if self.count < 1:
            raise DoelError(f"--nodes must be >= 1, got {self.count}")
        if self.rank is not None and not 0 <= self.rank < self.count:
            raise DoelError(f"--node-rank {self.rank}: must be in 0..{self.count - 1}")

    @property
    def first(self) -> bool:
        """Runs every stage (the others run training alone)."""
        return not self.rank

    @property
    def here(self) -> int:
        """torchrun agents this machine starts."""
        return self.count if self.rank is None else 1


def node_stages(stages: list[str], nodes: Nodes) -> list[str]:
    """The stages this node runs: all on the first node, the train stage alone on the others."""
    return list(stages) if nodes.first else [s for s in stages if s == "train"]


def rendezvous_args(nodes: Nodes, gpus_per_node: int, rdzv_id: str) -> list[str]:
    """torchrun's options for one node of `nodes` (--standalone on one)."""
    if nodes.count == 1:
        return ["--standalone", f"--nproc_per_node={gpus_per_node}"]
    return [
        f"--nnodes={nodes.count}",
        f"--nproc_per_node={gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={nodes.master_addr}:{nodes.port}",
        f"--rdzv-id={rdzv_id}",
    ]


def run_agents(cmd_for, nodes: Nodes, where: Path, log) -> int:
    """Start this machine's agents (`cmd_for(rdzv_id)` builds one's command) and wait for them:
    the exit status, 0 when all succeeded. Several agents here each get a working folder of
    their own; when one fails the others are stopped (they would wait in the rendezvous)."""
    rdzv_id = f"doel-{secrets.token_hex(4)}"
    cmd = cmd_for(rdzv_id)
    log("under torchrun: " + " ".join(cmd))
    if nodes.here == 1:
        return subprocess.run(cmd, check=False).returncode
    agents = []
    for k in range(nodes.here):
        cwd = where / f"node-{k}"
        cwd.mkdir(parents=True, exist_ok=True)
        agents.append(subprocess.Popen(cmd, cwd=cwd))
    while any(a.poll() is None for a in agents):
        if any(a.returncode for a in agents):
            for a in agents:
                if a.poll() is None:
                    a.terminate()
        time.sleep(0.2)
    return next((a.returncode for a in agents if a.returncode), 0)


def lead(cmd_for, nodes: Nodes, stages: Path, fingerprint: str, log) -> int:
    """The first node's training: announce the rendezvous to the other nodes, run its agent."""
    rdzv_id = f"doel-{fingerprint}-{secrets.token_hex(4)}"
    marker = stages / LAUNCH
    atomic_write_json(marker, {"fingerprint": fingerprint, "id": rdzv_id, "nodes": nodes.count})
    try:
        cmd = cmd_for(rdzv_id)
        log(f"node 0 of {nodes.count} under torchrun: " + " ".join(cmd))
        return subprocess.run(cmd, check=False).returncode
    finally:
        marker.unlink(missing_ok=True)


def clear_launch(stages: Path) -> None:
    """The first node, at its start: a killed run's announcement must not call the others."""
    (stages / LAUNCH).unlink(missing_ok=True)


def follow(cmd_for, nodes: Nodes, stages: Path, fingerprint: str, done, log, poll_s=2.0) -> None:
    """A node after the first: wait for the first node's announcement of this training, join
    it, until `done()` (the train stage finished with these settings). An agent that fails
    (an announcement a killed run left, a training that failed) waits for the next one."""
    marker, joined, said = stages / LAUNCH, None, 0.0
    while not done():
        launch = read_json(marker)
        if launch and launch["fingerprint"] == fingerprint and launch["id"] != joined:
            joined = launch["id"]
            cmd = cmd_for(joined)
            log(f"node {nodes.rank} of {nodes.count} under torchrun: " + " ".join(cmd))
            if subprocess.run(cmd, check=False).returncode == 0:
                return
            log(f"node {nodes.rank}: the agent failed; waiting for the first node's next start")
        elif time.monotonic() - said > 300:
            log(f"node {nodes.rank}: waiting for the first node to start training ({marker})")
            said = time.monotonic()
        time.sleep(poll_s)
    log(f"node {nodes.rank}: training is complete; the first node runs the stages after it")
