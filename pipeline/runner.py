"""`doel recipe`: the stages of a recipe, each skipped when its outputs are complete.

data → tokenizer (+ fertility) → shards → verify → train → eval (+ model card) → sft (the
optional chat fine-tuning) → export → summary, all in RUN (default out/NAME).
RUN/stages/STAGE.json records a stage: the fingerprint of the settings it depends on (chained
through the stages before it, so a new tokenizer redoes the shards, training and what follows),
whether it finished, and the seconds spent on it over every attempt (the summary's time and
cost are what was paid, interruptions included). The stages that read a model (eval, sft,
export) also fingerprint its weights by the sha256 its checksums.json records, so a base
trained further redoes the chat fine-tuning and the bundles made from it.

Training runs in this process on one device. On several GPUs only the training stage goes
under torchrun, as a child process (`torchrun --no-python ... doel-train fit`): the
data, tokenizer and export stages must run once, not once per rank, and a crashed rank is
restarted by torchrun from the last checkpoint without repeating them. The verify stage runs
on one GPU the checks `fit` leaves out, so the two together are the whole suite. On several
nodes (--nodes) the first runs every stage and the others join its training alone
(pipeline/nodes.py); --gpus is then a node's, and the plan's GPUs those of all nodes.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import partial
from pathlib import Path

import torch

from doel.contracts import checksums, read_json
from doel.pipeline.budget import (
    Need,
    check_stage,
    estimate_needs,
    hidden_matrix_count,
    parameter_count,
    probe,
    require_answer,
)
from doel.pipeline.fetch import corpus
from doel.pipeline.nodes import Nodes, clear_launch, follow, node_stages
from doel.pipeline.order import DEPENDS, STAGES
from doel.pipeline.spec import load_recipe, make_plan, resolve_recipe
from doel.pipeline.stages import STAGE_FUNCTIONS, gpu_slice, torchrun_command
from doel.train.common import DoelError, atomic_write_json


def _weights_sha256(folder: Path) -> str | None:
    """The sha256 a model folder's checksums.json records for its weights; None without one."""
    try:
        files = checksums.recorded(folder) or {}
    except ValueError:  # a damaged record: the stage that reads the folder says so
        return None
    return (files.get("model.safetensors") or {}).get("sha256")


class RecipeRun:
    def __init__(self, plan, log=print, probe_fn=probe, stdin=None, on_chunk=None, nodes=None):
        self.plan, self.log, self.probe, self.stdin = plan, log, probe_fn, stdin
        self.on_chunk, self.nodes = on_chunk, nodes or Nodes()
        out = plan.out
        self.data, self.tok_path = out / "data", out / "tokenizer" / "tokenizer.json"
        self.shards, self.run, self.stages = out / "shards", out / "run", out / "stages"
        self.chat = out / "sft"  # the chat fine-tuning's run folder, when [sft] is enabled
        cfg = plan.train_cfg
        quants = {q: q in plan.recipe.export.mobile for q in plan.recipe.export.quants}
        self.needs = estimate_needs(
            {n: c - self._fetched(n) for n, c in plan.recipe.corpus_chars.items()},
            {s.name: s.language for s in plan.recipe.sources},
            plan.recipe.data.chars_per_token,
            plan.recipe.tokenizer.vocab_size,
            parameter_count(cfg.model),
            cfg.keep_checkpoints,
            quants,
            plan.recipe.tokenizer.max_chars,
            plan.recipe.prepare.overlap_sample,
            plan.recipe.data.chunk_chars,
            muon_params=hidden_matrix_count(cfg.model) if cfg.optimizer == "muon" else 0,
        )
        self.needs["sft"] = self.needs["train"]  # checkpoints of the same model

    def model_folder(self) -> Path:
        """What the export stage bundles: the chat model when the recipe fine-tunes one."""
        return self.chat / "final" if self.plan.recipe.sft.enabled else self.run / "final"

    def _fetched(self, name: str) -> int:
        state = read_json(self.plan.out / "data" / name / "progress.json", strict=True) or {}
        return state.get("chars", 0)

    def fingerprint(self, stage: str) -> str:
        before, parts = DEPENDS[stage]
        whole = self.plan.fingerprint_of(*parts)
        if stage == "data":  # local files standing in for sources are part of the data
            names = {s.name for s in self.plan.recipe.sources}
            whole["local"] = {n: p for n, p in self.plan.local.items() if n in names}
        if stage == "eval":  # the task files found, wherever they came from
            whole["tasks"] = self.plan.tasks
            hub = {n: [s, self.plan.local.get(n)] for n, s in self.plan.hub_tasks.items()}
            whole |= {"hub_tasks": hub} if hub else {}
        if stage in ("eval", "sft", "export"):  # the model it reads, by content (no hashing)
            model = self.model_folder() if stage == "export" else self.run / "final"
            whole["model_sha256"] = _weights_sha256(model)
        text = json.dumps([before and self.fingerprint(before), whole], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def complete(self, stage: str) -> bool:
        """Finished with the current settings, and its outputs are still there."""
        if stage == "summary":
            return False  # cheap, and it reads every other stage
        mark = read_json(self.stages / f"{stage}.json", strict=True)
        if not mark or not mark["done"] or mark["fingerprint"] != self.fingerprint(stage):
            return False
        outputs = {
            "data": [self.data / s.name / "progress.json" for s in self.plan.recipe.sources],
            "tokenizer": [self.tok_path, self.tok_path.parent / "fertility.json"],
            "shards": [self.shards / "meta.json"],
            "verify": [self.plan.out / "verify" / "verify.json"],
            "train": [self.run / "final" / "model.safetensors"],
            "eval": [self.plan.out / "eval.json"],
            "sft": [self.model_folder() / "model.safetensors"],
            "export": [
                self.plan.out / f"bundle-{q}" / "manifest.json"
                for q in self.plan.recipe.export.quants
            ],
        }[stage]
        return all(p.exists() for p in outputs)

    def preflight(self, stages: list[str]) -> None:
        """Everything that can be refused before a byte is downloaded."""
        plan, todo = self.plan, [s for s in stages if not self.complete(s)]
        if plan.missing_tasks:
            self.log(
                "note: these task files are missing and will be left out (--eval-dir DIR, or "
                f"--local NAME=PATH): {plan.missing_tasks}"
            )
        if "train" in todo:
            require_answer(plan.yes, self.stdin)
            self._check_devices()
        hub = [s.dataset for s in plan.recipe.sources if s.name not in plan.local]
        hub += [s for n, s in plan.hub_tasks.items() if n not in plan.local]
        if "sft" in todo and plan.recipe.sft.enabled:
            hub += [d for d in plan.recipe.sft.data if d.startswith("hf:")]
        if ("data" in todo or "sft" in todo) and hub and not plan.dry_run:
            try:
                import datasets  # noqa: F401
            except ModuleNotFoundError:
                raise DoelError(
                    f"streaming {hub} needs the datasets package: pip install 'doel[hub]'"
                ) from None
        free, ram = self.probe(plan.out)
        disk = sum(self.needs[s].disk for s in todo)
        check_stage("the whole recipe", Need(disk, 0, f"stages {todo}"), free, ram, plan.out)

    def _check_devices(self) -> None:

        plan = self.plan
        if plan.dry_run or plan.train_cfg.device == "cpu":
            return
        if not torch.cuda.is_available():
            raise DoelError(
                "training the recipe needs a CUDA GPU and torch sees none. Try it here with "
                "--dry-run, or run the data stages on this machine with --until shards"
            )
        here = plan.gpus // self.nodes.count * self.nodes.here  # this machine's agents' GPUs
        if here > torch.cuda.device_count():
            raise DoelError(f"{here} GPUs here, but {torch.cuda.device_count()} are visible")

    def stage(self, name: str, fn) -> None:
        path = self.stages / f"{name}.json"
        mark = read_json(path, strict=True) or {"seconds": 0.0, "attempts": 0}
        if self.complete(name):
            self.log(f"[{name}] complete ({mark['seconds']:.1f} s before): skipped")
            return
        self.log(f"[{name}]")
        free, ram = self.probe(self.plan.out)
        check_stage(name, self.needs[name], free, ram, self.plan.out)
        t0, done = time.perf_counter(), False
        try:
            fn(self)
            done = True
        finally:  # an interrupted stage's time was paid too
            atomic_write_json(
                path,
                {
                    "fingerprint": self.fingerprint(name) if name in DEPENDS else None,
                    "done": done,
                    "seconds": mark["seconds"] + time.perf_counter() - t0,
                    "attempts": mark["attempts"] + 1,
                },
            )

    def corpus(self) -> dict:

        sources = self.plan.recipe.sources
        progress = {
            s.name: read_json(self.data / s.name / "progress.json", strict=True) for s in sources
        }
        return corpus(self.plan.recipe, self.data, progress)


def run_recipe(plan, until: str = "summary", log=print, **kw) -> dict:
    """Run the stages up to `until`; returns the summary (None when stopped earlier)."""
    if until not in STAGES:
        raise DoelError(f"--until {until!r}: choose one of {STAGES}")
    r = RecipeRun(plan, log=log, **kw)
    nodes, cfg = r.nodes, plan.train_cfg
    stages = node_stages(STAGES[: STAGES.index(until) + 1], nodes)
    where = f" on {nodes.count} nodes" if nodes.count > 1 else ""
    log(
        f"recipe {plan.recipe.name}{' (dry run)' if plan.dry_run else ''} -> {plan.out}: "
        f"{plan.recipe.token_budget:,} tokens = {cfg.steps:,} steps of "
        f"{cfg.tokens_per_step * plan.gpus:,} on {plan.gpus} device(s){where}; stages {stages}"
    )
    if not nodes.first:  # the first node prepares, announces and reports; this one trains
        if stages:
            r._check_devices()
            cmd_for = partial(torchrun_command, plan, r.shards, r.run, r.tok_path, nodes=nodes)
            done = partial(r.complete, "train")
            follow(cmd_for, nodes, r.stages, r.fingerprint("train"), done, log)
        return None
    clear_launch(r.stages)
    r.preflight(stages)
    atomic_write_json(plan.out / "recipe.json", plan.resolved() | {"nodes": nodes.count})
    for name in stages:
        r.stage(name, STAGE_FUNCTIONS[name])
    return read_json(plan.out / "summary.json", strict=True) if until == "summary" else None


def main(args) -> None:

    sets = list(args.set)
    if args.price_per_hour is not None:
        sets.append(f"hourly_price={args.price_per_hour}")
    recipe = load_recipe(resolve_recipe(args.recipe), sets, dry_run=args.dry_run)
    known = [s.name for s in recipe.sources] + list(recipe.eval.tasks)
    local = {}
    for item in args.local:
        name, sep, path = item.partition("=")
        if not sep or name not in known:
            raise DoelError(f"--local {item!r}: expected NAME=PATH with NAME one of {known}")
        local[name] = path
    # The slice measures one GPU; its projection is for one GPU too.
    gpus = args.gpus or (1 if args.dry_run or args.gpu_slice else _visible_gpus())
    if gpus < 1:
        raise DoelError(f"--gpus must be >= 1, got {gpus}")
    nodes = _nodes(args)
    out = args.out or f"out/{recipe.name}{'-dry-run' if args.dry_run else ''}"
    # The plan's GPUs are all nodes': the global batch is split over every rank.
    world = gpus * nodes.count
    plan = make_plan(recipe, out, args.dry_run, world, args.yes, local, args.eval_dir)
    if args.gpu_slice:
        where = Path(args.out or "benchmarks/results")
        gpu_slice(
            plan.train_cfg, recipe.train.preset, recipe.token_budget, args.slice_seconds, where
        )
        return
    run_recipe(plan, args.until, nodes=nodes)


def _nodes(args) -> Nodes:
    """--nodes, --node-rank, --master-addr, --master-port. All nodes on this machine (no
    --node-rank) meet on a free port unless one is given: two such runs must not collide."""
    if args.node_rank is not None and args.nodes == 1:
        raise DoelError("--node-rank needs --nodes N (N > 1): the job's node count")
    port = args.master_port
    if port is None:
        port = _free_port() if args.node_rank is None else 29400
    return Nodes(args.nodes, args.node_rank, args.master_addr, port)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> int:

    return max(1, torch.cuda.device_count())
