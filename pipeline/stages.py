"""What each stage of a recipe does, as a function of the running recipe `r`
(pipeline/runner.py: its plan, its folders, its log). Each reads what the stages before it
wrote and writes its own outputs; whether it runs at all is decided by the runner. Also the GPU
slice: a fixed-length run of the real configuration on synthetic tokens.
"""

from __future__ import annotations

import datetime
import json
import math
import shutil
import sys
from functools import partial
from pathlib import Path

import torch

from doel.contracts import read_json
from doel.pipeline.budget import (
    confirm,
    format_projection,
    measure_steps,
    overheads,
    projection,
)
from doel.pipeline.fetch import fetch_all, standins
from doel.pipeline.nodes import Nodes, lead, rendezvous_args, run_agents
from doel.pipeline.summary import write_card, write_summary
from doel.train.checkpoint import latest_checkpoint
from doel.train.checks.suite import fit_subset, run_suite, select
from doel.train.common import SAMPLE_DIR, DoelError, atomic_write_json
from doel.train.config import load_config
from doel.train.data.conversations import SFTConfig
from doel.train.data.fertility import fertility, format_report, load_any
from doel.train.data.loader import TokenLoader
from doel.train.data.prepare import parse_weights, prepare
from doel.train.data.textio import iter_source, resolve_sources
from doel.train.data.tokenizer import train_tokenizer
from doel.train.dist import resolve_device
from doel.train.evals.heldout import evaluate_checkpoint, format_eval
from doel.train.evals.hubtasks import fetch_tasks
from doel.train.fit import fit
from doel.train.loop import batches_on
from doel.train.metrics import format_duration
from doel.train.sft import sft

SAMPLE_CHAT = SAMPLE_DIR / "chat.jsonl"  # the dry run's


def data(r) -> None:

    local = r.plan.local
    if r.plan.dry_run:
        local = standins(r.plan.recipe, r.plan.out / "standins", local)
    fetch_all(r.plan.recipe, local, r.data, r.log, r.on_chunk)
    hub_tasks(r)


def hub_tasks(r) -> dict[str, str]:
    """The recipe's hub task sets fetched once into RUN/data/tasks (the data stage fetches them
    before any training is paid for; the eval stage finds them there). A set that cannot be
    fetched is named and left out; a dry run reads only --local stand-ins."""
    plan = r.plan
    found, missing = fetch_tasks(
        plan.hub_tasks, r.data / "tasks", plan.local, offline=plan.dry_run, log=r.log
    )
    atomic_write_json(r.data / "tasks.json", {"found": found, "missing": missing})
    return found


def tokenizer(r) -> None:

    c = r.corpus()
    sources = resolve_sources(c["train"])
    weights = parse_weights(c["weights"], sources)
    train_tokenizer(sources, r.plan.recipe.tokenizer, r.tok_path.parent, weights)
    held = resolve_sources(c["heldout_dirs"])
    report = fertility(load_any(r.tok_path), (d for s in held for d in iter_source(s)))
    text = format_report(str(r.tok_path), report)
    r.log(text)
    atomic_write_json(r.tok_path.parent / "fertility.json", report)
    (r.tok_path.parent / "fertility.md").write_text(text + "\n", encoding="utf-8")


def shards(r) -> None:

    c = r.corpus()
    prepare(
        r.tok_path, c["train"], r.shards, r.plan.recipe.prepare, c["weights"],
        c["heldout_dirs"], log=r.log,
    )  # fmt: skip


def verify(r) -> None:

    fit_runs = fit_subset(distributed=r.plan.gpus > 1)  # what fit runs before step 1
    names = [n for n in select("full") if n not in fit_runs]
    out = r.plan.out / "verify"
    report = run_suite(
        r.plan.train_cfg,
        r.shards,
        "full",
        out,
        tokenizer=r.tok_path,
        vcfg=r.plan.recipe.verify,
        checks=names,
        log=r.log,
    )
    if not report.ok:
        raise DoelError(f"the verification suite failed {report.failed}: see {out}/verify.md")


def train(r) -> None:

    plan, cfg = r.plan, r.plan.train_cfg
    started = r.stages / "train.started.json"
    if (read_json(started, strict=True) or {}).get("fingerprint") != r.fingerprint("train"):
        for old in ("checkpoints", "final", "metrics.jsonl"):  # another recipe's run
            p = r.run / old
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    last = latest_checkpoint(r.run)
    done = int(last.name.split("-")[1]) if last else 0
    device = resolve_device(cfg.device)
    loader = TokenLoader(r.shards, "train", cfg.batch_size, cfg.seq_len, cfg.seed)
    spec = plan.recipe.train
    m = measure_steps(
        cfg,
        lambda: batches_on(loader, device, cfg.grad_accum),
        spec.measure_warmup,
        spec.measure_steps,
        log=r.log,
    )
    p = projection(cfg.steps, done, m["sec_per_step"], plan.gpus, cfg.hourly_price, r.nodes.count)
    extra = overheads(cfg, m["sec_per_step"], m["parameters"])
    tokens = cfg.steps * cfg.tokens_per_step * plan.gpus
    r.log(format_projection(m, p, tokens, cfg.optimizer, extra))
    atomic_write_json(r.plan.out / "measure.json", {"measured": m, "projection": p})
    cost = f"{format_duration(p['remaining_s'])} and ${p['remaining_usd']:,.2f}"
    confirm(f"train for about {cost}?", plan.yes, r.stdin)
    atomic_write_json(started, {"fingerprint": r.fingerprint("train")})
    _launch(r)


def _launch(r) -> None:
    """One device: `fit` in this process. Several: `fit` under torchrun, a child process; on
    several nodes, this node's agent (pipeline/nodes.py: the first node announces it)."""
    plan, nodes = r.plan, r.nodes
    if plan.gpus == 1:
        fit(plan.train_cfg, r.shards, r.run, tokenizer=r.tok_path, log=r.log)
        return
    cmd_for = partial(torchrun_command, plan, r.shards, r.run, r.tok_path, nodes=nodes)
    if nodes.rank is None:  # one node, or every node on this machine
        rc = run_agents(cmd_for, nodes, plan.out / "nodes", r.log)
    else:
        rc = lead(cmd_for, nodes, r.stages, r.fingerprint("train"), r.log)
    if rc:
        raise DoelError(
            f"training under torchrun failed (exit {rc}; its log is above). Rerun the "
            "recipe: it resumes from the last checkpoint"
        )


def evaluation(r) -> None:

    spec, cfg = r.plan.recipe.eval, r.plan.train_cfg
    result = evaluate_checkpoint(
        r.run / "final",
        r.corpus()["heldout"],
        seq_len=cfg.seq_len,
        max_chars=spec.max_chars,
        device=_device_name(cfg),
        max_new_tokens=spec.max_new_tokens,
        tasks=r.plan.tasks | hub_tasks(r),
        limit=spec.task_limit or None,
    )
    atomic_write_json(r.plan.out / "eval.json", result)
    text = format_eval(result)
    (r.plan.out / "eval.md").write_text(text + "\n", encoding="utf-8")
    r.log(text)
    write_card(r, result)


def chat(r) -> None:
    """The optional chat fine-tuning of the trained model into RUN/sft (`doel-train sft`, on
    one device): the export stage then bundles the chat model."""
    plan, spec = r.plan, r.plan.recipe.sft
    if not spec.enabled:
        r.log("sft: off in this recipe ([sft] enabled = true turns it on)")
        return
    data = [str(SAMPLE_CHAT)] if plan.dry_run else list(spec.data)
    sets = [*spec.set, *(spec.dry_run_set if plan.dry_run else ())]
    cfg = load_config(SFTConfig, plan.preset, [*sets, f"hourly_price={plan.recipe.hourly_price}"])
    # Another recipe's run (or none) starts over; an interrupted one with these settings resumes.
    mark = read_json(r.stages / "sft.json", strict=True) or {}
    fresh = mark.get("fingerprint") != r.fingerprint("sft")
    sft(cfg, data, r.run / "final", r.chat, fresh=fresh, log=r.log)


def export(r) -> None:
    from doel.export.bundle import ExportOptions, bundle_bytes, export_checkpoint, summary

    spec, c, rows = r.plan.recipe.export, r.corpus(), {}
    texts = tuple(f for files in c["heldout"].values() for f in files)
    for quant in spec.quants:
        out = r.plan.out / f"bundle-{quant}"
        opts = ExportOptions(
            quant=quant,
            mobile=quant in spec.mobile,
            texts=texts,
            eval_tokens=spec.eval_tokens,
            force=True,
            log=lambda m: r.log(f"  {m}"),
        )
        manifest = export_checkpoint(r.model_folder(), out, opts)
        r.log(summary(out, manifest))
        rows[quant] = {
            "path": str(out),
            "bytes": bundle_bytes(manifest),
            "mobile": quant in spec.mobile,
            "loss_increase_nats_per_token": manifest["parity"]["loss"]["increase_nats_per_token"],
        }
    atomic_write_json(r.plan.out / "exports.json", rows)


def _device_name(cfg) -> str:

    return resolve_device(cfg.device).type


def console_script(name: str) -> str:
    """The path of one of this installation's console scripts (beside the interpreter in a
    virtualenv, else on PATH). A script imports the installed package by its absolute name,
    so a `train.py` in the working directory cannot stand in for it as with `python -m`."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        raise DoelError(
            f"{name} is not installed beside {sys.executable} nor on PATH; reinstall doel: "
            "pip install -e '.[train]'"
        )
    return found


def torchrun_command(plan, shards: Path, run: Path, tok_path: Path, rdzv_id="", nodes=None):
    """`doel-train fit` under torchrun with the recipe's training config (the preset and its
    overrides, as on the command line), for one node of `nodes` (pipeline/nodes.py; plan.gpus
    counts the GPUs of all of them). --no-python runs the console script itself, never a
    `train` module found in the working directory. --max-restarts: a crashed rank brings the
    job back from the last checkpoint; the recipe cleared old runs before, so no --fresh
    here."""
    nodes = nodes or Nodes()
    cmd = [console_script("torchrun")]
    cmd += rendezvous_args(nodes, plan.gpus // nodes.count, rdzv_id)
    cmd += ["--max-restarts=2", "--no-python", console_script("doel-train"), "fit"]
    cmd += ["--config", str(plan.preset), "--data", str(shards), "--out", str(run)]
    cmd += ["--tokenizer", str(tok_path)]
    for item in plan.train_sets:
        cmd += ["--set", item]
    return cmd


def summary(r) -> None:

    write_summary(r)


STAGE_FUNCTIONS = {
    "data": data,
    "tokenizer": tokenizer,
    "shards": shards,
    "verify": verify,
    "train": train,
    "eval": evaluation,
    "sft": chat,
    "export": export,
    "summary": summary,
}


def gpu_slice(cfg, preset: str, token_budget: int, seconds: float, out: Path, log=print) -> dict:
    """A fixed-length run of the real configuration on synthetic tokens (throughput does not
    depend on their values): tokens/s, MFU, memory, and the projected time and cost of the
    token budget, written to out/recipe_slice_<device>_<date>.{json,md}."""

    if not torch.cuda.is_available():
        raise DoelError(
            "--gpu-slice measures the real configuration on a CUDA GPU, and torch sees none "
            f"here (torch {torch.__version__}, cuda available: False). Run it on the GPU "
            "machine, or try the recipe on this one with --dry-run"
        )
    device = torch.device("cuda")
    shape = (cfg.batch_size, cfg.seq_len)
    pool = [torch.randint(0, cfg.model.vocab_size, shape, device=device) for _ in range(4)]
    batches = [(x, torch.roll(x, -1, 1)) for x in pool]

    def next_batches():
        return [batches[i % 4] for i in range(cfg.grad_accum)]

    log(f"GPU slice: {preset} for {seconds:.0f} s of timed steps on synthetic tokens")
    m = measure_steps(cfg, next_batches, 3, 5, seconds=seconds, log=log)
    steps = math.ceil(token_budget / cfg.tokens_per_step)
    p = projection(steps, 0, m["sec_per_step"], 1, cfg.hourly_price)
    text = format_projection(
        m, p, token_budget, cfg.optimizer, overheads(cfg, m["sec_per_step"], m["parameters"])
    )
    log(text)
    day = datetime.date.today().isoformat()
    slug = "".join(c if c.isalnum() else "-" for c in m["device"].lower()).strip("-")
    stem = Path(out) / f"recipe_slice_{slug}_{day}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    result = {"date": day, "preset": preset, "measured": m, "projection": p}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    stem.with_suffix(".md").write_text(f"# GPU slice: `{preset}`\n\n{text}\n", encoding="utf-8")
    log(f"wrote {stem}.json and .md")
    return result
