"""The recipe on several nodes (`doel recipe --nodes N`): which stages each node runs, a node
that waits for the first one's training and joins it, the dry run on two local agents, and
the launch files in recipes/bangla-0.4b/ read as their own tools read them: the SLURM batch
script run by bash against a stand-in srun, the SkyPilot task by SkyPilot's parser (installed
into a virtualenv of its own once; skipped where it cannot be installed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from doel.pipeline.budget import hourly_cost
from doel.pipeline.cli import build_parser, main
from doel.pipeline.nodes import LAUNCH, Nodes, follow, node_stages
from doel.pipeline.order import STAGES
from doel.pipeline.spec import load_recipe, make_plan, resolve_recipe
from doel.pipeline.stages import torchrun_command
from doel.train.common import DoelError

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "recipes" / "bangla-0.4b"
SKYPILOT = "skypilot==0.14.1"
SKY_VENV = Path.home() / ".cache" / "doel" / "skypilot-0.14.1"


def test_the_first_node_runs_every_stage_and_the_others_train_alone():
    assert node_stages(STAGES, Nodes(2, 0)) == list(STAGES)
    assert node_stages(STAGES, Nodes(2)) == list(STAGES)  # every node on this machine
    assert node_stages(STAGES, Nodes(4, 3)) == ["train"]
    assert node_stages(STAGES[:3], Nodes(4, 3)) == []  # --until shards: nothing to join
    with pytest.raises(DoelError, match="--node-rank 2: must be in 0..1"):
        Nodes(2, 2)
    with pytest.raises(SystemExit, match="--node-rank needs --nodes"):
        main(["recipe", "--dry-run", "--node-rank", "1"])


def test_the_plan_splits_the_global_batch_over_every_gpu_of_every_node(tmp_path):
    recipe = load_recipe(FOLDER / "recipe.toml")
    one, two = make_plan(recipe, tmp_path, gpus=8), make_plan(recipe, tmp_path, gpus=16)
    assert two.train_cfg.grad_accum * 2 == one.train_cfg.grad_accum
    cmd = torchrun_command(two, tmp_path, tmp_path / "run", tmp_path, "job-1", Nodes(2, 1, "a"))
    assert {"--nnodes=2", "--nproc_per_node=8", "--rdzv-endpoint=a:29400"} <= set(cmd)
    assert "--rdzv-id=job-1" in cmd and "--standalone" not in cmd


def test_a_node_joins_the_first_ones_training_and_skips_an_announcement_left_behind(tmp_path):
    """A killed run's announcement: the agent fails (nobody hosts that rendezvous), and the
    node waits for the next announcement instead of giving up or joining it again."""
    (tmp_path / LAUNCH).write_text(json.dumps({"fingerprint": "f", "id": "stale"}))
    joined, logs = [], []

    def cmd_for(rdzv_id):
        joined.append(rdzv_id)
        if rdzv_id == "stale":  # announce the live one while this agent fails
            (tmp_path / LAUNCH).write_text(json.dumps({"fingerprint": "f", "id": "live"}))
            return [sys.executable, "-c", "raise SystemExit(3)"]
        return [sys.executable, "-c", "pass"]

    follow(cmd_for, Nodes(2, 1), tmp_path, "f", lambda: False, logs.append, poll_s=0.01)
    assert joined == ["stale", "live"]
    assert any("the agent failed" in line for line in logs)
    # Another recipe's announcement is not this training's; a finished one ends the wait.
    (tmp_path / LAUNCH).write_text(json.dumps({"fingerprint": "other", "id": "x"}))
    done = iter([False, False, True])
    follow(cmd_for, Nodes(2, 1), tmp_path, "f", lambda: next(done), logs.append, poll_s=0.01)
    assert joined == ["stale", "live"] and "training is complete" in logs[-1]


@pytest.mark.slow
def test_the_dry_run_trains_on_two_local_agents_and_counts_both(tmp_path):
    out = tmp_path / "dry"
    main(["recipe", "--dry-run", "--yes", "--nodes", "2", "--out", str(out), "--until", "train"])
    assert (out / "run" / "final" / "model.safetensors").is_file()
    assert all((out / "nodes" / f"node-{k}").is_dir() for k in (0, 1))  # a working folder each
    assert json.loads((out / "recipe.json").read_text())["nodes"] == 2
    p = json.loads((out / "measure.json").read_text())["projection"]
    assert (p["gpus"], p["nodes"]) == (2, 2)
    assert p["total_usd"] == pytest.approx(p["total_s"] / 3600 * 2 * p["hourly_price"])
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("kind") == "train" for r in rows)
    assert not (out / "stages" / LAUNCH).exists()


def quoted_cost(text: str) -> tuple[int, int, str, float, float]:
    """(nodes, GPUs a node, GPU, $ a GPU-hour, $ an hour) from a launch file's Cost line."""
    m = re.search(
        r"Cost: (\d+) nodes x (\d+) (\S+) = (\d+) GPUs at the recipe's \$([\d.]+) a GPU-hour"
        r"[^=]*= \$([\d.,]+) an hour",
        text.replace("\n#", ""),
    )
    assert m, "the file quotes no cost"
    nodes, per, gpu, total, price, hourly = m.groups()
    assert int(total) == int(nodes) * int(per)
    return int(nodes), int(per), gpu, float(price), float(hourly.replace(",", ""))


def check_cost(text: str, nodes: int, gpus: int, gpu: str) -> None:
    """The quoted cost is the recipe's own: its hourly price times every GPU of the job."""
    recipe = load_recipe(FOLDER / "recipe.toml")
    assert quoted_cost(text) == (
        nodes, gpus, gpu, recipe.hourly_price, hourly_cost(nodes * gpus, recipe.hourly_price)
    )  # fmt: skip


def recipe_args(argv: list[str], out: Path, rank: int, master: str):
    """The `doel recipe` arguments a launch file gives one node, parsed by doel's own parser,
    and the torchrun command that node's training runs."""
    assert Path(argv[0]).name == "doel" and argv[1] == "recipe"
    args = build_parser().parse_args(argv[1:])
    assert args.yes and args.out == str(out) and args.recipe == "bangla-0.4b"
    assert (args.node_rank, args.master_addr) == (rank, master)
    plan = make_plan(load_recipe(resolve_recipe(args.recipe)), out, gpus=args.gpus * args.nodes)
    nodes = Nodes(args.nodes, args.node_rank, args.master_addr, args.master_port)
    return args, torchrun_command(plan, out / "shards", out / "run", out / "tok", "id", nodes)


def test_the_slurm_script_runs_the_recipe_on_every_node_it_asks_for(tmp_path):
    script = FOLDER / "slurm.sbatch"
    text = script.read_text(encoding="utf-8")
    sbatch = dict(
        line.removeprefix("#SBATCH --").partition("=")[::2]  # --exclusive: ""
        for line in text.splitlines()
        if line.startswith("#SBATCH --")
    )
    nodes, gpu_type, gpus = int(sbatch["nodes"]), *sbatch["gpus-per-node"].split(":")
    assert sbatch["ntasks-per-node"] == "1"  # one `doel recipe` (one torchrun agent) a node
    check_cost(text, nodes, int(gpus), gpu_type.upper())
    # bash runs the script with stand-ins for srun and scontrol that record what they get.
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    record = f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n"
    for name in ("srun", "doel"):
        (bin_ / name).write_text(record, encoding="utf-8")
        (bin_ / name).chmod(0o755)
    (bin_ / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n", encoding="utf-8")
    (bin_ / "scontrol").chmod(0o755)
    env = os.environ | {"PATH": f"{bin_}:{os.environ['PATH']}", "DOEL": str(bin_ / "doel")}
    env |= {"SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "gpu-[a-b]"}
    env |= {"SLURM_JOB_NUM_NODES": str(nodes)}
    srun = json.loads(subprocess.run(["bash", script], env=env, capture_output=True,
                                     text=True, check=True).stdout)  # fmt: skip
    assert srun[:3] == ["--kill-on-bad-exit=1", "bash", "-c"]
    for rank in range(nodes):  # each task runs srun's command with its own SLURM_NODEID
        task = subprocess.run(["bash", "-c", srun[3]], env=env | {"SLURM_NODEID": str(rank)},
                              capture_output=True, text=True, check=True)  # fmt: skip
        argv = [str(bin_ / "doel"), *json.loads(task.stdout)]
        args, torchrun = recipe_args(argv, tmp_path / "out" / "bangla-0.4b", rank, "gpu-a")
        assert (args.nodes, args.gpus) == (nodes, int(gpus))
        assert {f"--nnodes={nodes}", f"--nproc_per_node={gpus}"} <= set(torchrun)
        assert "--rdzv-endpoint=gpu-a:29400" in torchrun


def sky_python() -> Path:
    """A Python with SkyPilot, made once in ~/.cache/doel (SkyPilot's many dependencies stay
    out of doel's own environment); the test skips where it cannot be installed."""
    python = SKY_VENV / "bin" / "python"
    if not python.is_file():
        venv.create(SKY_VENV, with_pip=True)
        pip = subprocess.run([python, "-m", "pip", "install", "-q", SKYPILOT],
                             capture_output=True, text=True, timeout=900)  # fmt: skip
        if pip.returncode:
            pytest.skip(f"cannot install {SKYPILOT}: {pip.stderr.strip()[-300:]}")
    return python


SKY_READ = """
import json, sys, yaml, sky
from sky.utils import common_utils, schemas
task = sky.Task.from_yaml(sys.argv[1])
common_utils.validate_schema(yaml.safe_load(open(sys.argv[2])), schemas.get_volume_schema(), "")
res = list(task.resources)
print(json.dumps({"nodes": task.num_nodes, "accelerators": res[0].accelerators,
                  "envs": task.envs, "volumes": task.volumes, "run": task.run}))
"""


@pytest.mark.slow
def test_the_skypilot_task_is_valid_to_skypilot_and_runs_the_recipe_on_each_node(tmp_path):
    task_file, volume_file = FOLDER / "sky.yaml", FOLDER / "sky-volume.yaml"
    python = sky_python()
    read = [python, "-c", SKY_READ, task_file, volume_file]
    proc = subprocess.run(read, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    task = json.loads(proc.stdout)
    ((gpu, gpus),) = task["accelerators"].items()
    check_cost(task_file.read_text(encoding="utf-8"), task["nodes"], gpus, gpu)
    mount, volume = next(iter(task["volumes"].items()))
    assert task["envs"]["RUN"].startswith(mount + "/")  # the run folder is on the shared volume
    assert f"name: {volume}" in volume_file.read_text(encoding="utf-8")
    # A typo is refused by the same parser: the check above can fail.
    bad = tmp_path / "bad.yaml"
    bad.write_text(task_file.read_text().replace("num_nodes:", "num_node:"), encoding="utf-8")
    assert subprocess.run([python, *read[1:3], bad, volume_file], capture_output=True).returncode
    # The run commands, as SkyPilot's environment fills them in on node 1.
    ips = "10.0.0.1\n10.0.0.2"
    env = task["envs"] | {"SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": "1"}
    env |= {"SKYPILOT_NUM_NODES": str(task["nodes"]), "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus)}
    run = task["run"].replace(".venv/bin/doel", "printf '%s\\n' doel")
    lines = subprocess.run(["bash", "-c", run], env=os.environ | env, capture_output=True,
                           text=True, check=True).stdout.splitlines()  # fmt: skip
    args, torchrun = recipe_args(lines, Path(task["envs"]["RUN"]), 1, "10.0.0.1")
    assert (args.nodes, args.gpus, args.price_per_hour) == (task["nodes"], gpus, 3.0)
    assert f"--nnodes={task['nodes']}" in torchrun and "--rdzv-endpoint=10.0.0.1:29400" in torchrun
