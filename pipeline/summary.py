"""The recipe's last words: the model card with the final evaluation, and RUN/summary.{json,md}
(time per stage over every attempt, tokens/s, MFU, dollars at the hourly price, the evaluation
table, the bundles). On several nodes the GPU-hours are those of every GPU of every node for
the whole wall time: the other nodes are rented while the first prepares the data too.
Everything is read back from the files the stages wrote, so a summary of a resumed run counts
the time of the runs before it.
"""

from __future__ import annotations

from pathlib import Path

from doel.contracts import read_json
from doel.pipeline.budget import hourly_cost
from doel.pipeline.order import STAGES
from doel.train.common import atomic_write_bytes, atomic_write_json
from doel.train.data.loader import read_meta
from doel.train.evals.modelcard import write_model_card
from doel.train.evals.scoring import format_tasks
from doel.train.metrics import format_duration, read_metrics


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v == v)  # NaN (no peak figure) left out
    return values[len(values) // 2] if values else None


def _train_rows(run: Path) -> list[dict]:

    path = run / "metrics.jsonl"
    return [r for r in read_metrics(path) if r["kind"] == "train"] if path.is_file() else []


def _hardware(r) -> tuple[str, bool]:
    measured = (read_json(r.plan.out / "measure.json") or {}).get("measured", {})
    device, nodes = measured.get("device", "cpu"), r.nodes.count
    if nodes > 1:
        return f"{nodes} nodes × {r.plan.gpus // nodes} × {device}", device != "cpu"
    return f"{r.plan.gpus} × {device}", device != "cpu"


def write_card(r, eval_result: dict) -> Path:
    """The final folder's model card again, now with the final evaluation."""

    final = r.run / "final"
    rows = _train_rows(r.run)
    state = {
        "step": rows[-1]["step"] if rows else 0,
        "tokens_seen": rows[-1]["tokens"] if rows else 0,
        "config": read_json(final / "train_config.json"),
    }
    hardware, gpu = _hardware(r)
    mark = read_json(r.stages / "train.json") or {}  # every attempt's time, as in the summary
    return write_model_card(
        final,
        meta=read_meta(r.shards),
        train_state=state,
        eval_result=eval_result,
        hardware=hardware,
        seconds=mark.get("seconds"),
        attempts=mark.get("attempts", 1),
        devices=r.plan.gpus,
        hourly_price=r.plan.train_cfg.hourly_price if gpu else None,
    )


def _eval_table(result: dict | None) -> dict:
    if not result:
        return {}
    languages = {
        lang: {
            "characters": x["model"]["chars"],
            "bits_per_char": x["model"]["bits_per_char"],
            "random_twin_bits_per_char": x["twin"]["bits_per_char"],
            "xz_bits_per_char": x["compressors"]["xz -9e"],
        }
        for lang, x in result["languages"].items()
    }
    keys = ("items", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "chance")
    tasks = {n: {k: t[k] for k in keys} for n, t in result.get("tasks", {}).items()}
    return {"languages": languages, "tasks": tasks}


def _data_table(r) -> dict:
    """Characters fetched per source against the recipe's target: a source that ran out
    early (Bengali Wikipedia is small) changes the mix, and the summary says so."""
    out = {}
    for name, target in r.plan.recipe.corpus_chars.items():
        p = read_json(r.data / name / "progress.json") or {}
        got = p.get("chars", 0)
        out[name] = {"characters": got, "target": target, "short": got < target}
    return out


def summary(r) -> dict:
    plan, price = r.plan, r.plan.train_cfg.hourly_price
    marks = {s: read_json(r.stages / f"{s}.json") for s in STAGES if s != "summary"}
    stages = {s: m for s, m in marks.items() if m}
    wall = sum(m["seconds"] for m in stages.values())
    train_s = stages.get("train", {}).get("seconds", 0.0)
    rows = _train_rows(r.run)
    measure = read_json(plan.out / "measure.json") or {}
    hardware, gpu = _hardware(r)
    return {
        "recipe": plan.recipe.name,
        "dry_run": plan.dry_run,
        "hardware": hardware,
        "gpus": plan.gpus,  # of all nodes: each is rented for the whole job
        "nodes": r.nodes.count,
        "stages": stages,
        "wall_seconds": wall,
        "training": {
            "steps": rows[-1]["step"] if rows else 0,
            "tokens": rows[-1]["tokens"] if rows else 0,
            "seconds": train_s,
            "tokens_per_s": _median([x["tokens_per_s"] for x in rows]),
            "mfu": _median([x["mfu"] for x in rows]),
            "measured_before": measure.get("measured"),
            "projection": measure.get("projection"),
        },
        "cost": {
            "hourly_price": price,
            "gpu_hours": wall / 3600 * plan.gpus,
            "total_usd": wall / 3600 * hourly_cost(plan.gpus, price),
            "training_usd": train_s / 3600 * hourly_cost(plan.gpus, price),
            "on_gpu": gpu,
        },
        "data": _data_table(r),
        "eval": _eval_table(read_json(plan.out / "eval.json")),
        "exports": read_json(plan.out / "exports.json") or {},
        "artifacts": {
            "tokenizer": str(r.tok_path),
            "shards": str(r.shards),
            "model": str(r.run / "final"),
            **({"chat_model": str(r.chat / "final")} if r.plan.recipe.sft.enabled else {}),
            "bundles": [str(plan.out / f"bundle-{q}") for q in plan.recipe.export.quants],
        },
    }


def _num(x, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "n/a"


def _eval_lines(ev: dict) -> list[str]:
    lines = []
    if ev:
        lines += ["", "| language | characters | bits/char | random twin | xz -9e |"]
        lines.append("|---|---:|---:|---:|---:|")
        for lang, x in ev["languages"].items():
            lines.append(
                f"| {lang} | {x['characters']:,} | {x['bits_per_char']:.3f} | "
                f"{x['random_twin_bits_per_char']:.3f} | {x['xz_bits_per_char']:.3f} |"
            )
        if ev["tasks"]:
            lines += ["", format_tasks(ev["tasks"])]
    return lines


def _export_lines(exports: dict) -> list[str]:
    lines = []
    if exports:
        lines += ["", "| bundle | folder | MB | ORT (mobile) | loss increase, nats/token |"]
        lines.append("|---|---|---:|---|---:|")
        for q, x in exports.items():
            lines.append(
                f"| {q} | {x['path']} | {x['bytes'] / 1e6:.1f} | {x['mobile']} | "
                f"{x['loss_increase_nats_per_token']:+.4f} |"
            )
    return lines


def markdown(s: dict) -> str:

    t, c = s["training"], s["cost"]
    mfu = _num(100 * t["mfu"], ".1f") + " %" if t["mfu"] is not None else "n/a"
    lines = [
        f"# Recipe `{s['recipe']}`{' (dry run)' if s['dry_run'] else ''}: summary",
        "",
        f"{s['hardware']}; {format_duration(s['wall_seconds'])} in all, "
        f"{c['gpu_hours']:.3f} GPU-hours, **${c['total_usd']:,.2f}** at "
        f"${c['hourly_price']:.2f}/GPU-hour (training ${c['training_usd']:,.2f})"
        + ("" if c["on_gpu"] else "; on a CPU, the dollars only show the arithmetic")
        + ".",
        "",
        f"Training: {t['steps']:,} steps, {t['tokens']:,} tokens in "
        f"{format_duration(t['seconds'])}, {_num(t['tokens_per_s'], ',.0f')} tokens/s "
        f"(median of the logged intervals), MFU {mfu}.",
        "",
        "| stage | seconds | attempts | finished |",
        "|---|---:|---:|---|",
    ]
    for name, m in s["stages"].items():
        lines.append(f"| {name} | {m['seconds']:.1f} | {m['attempts']} | {m['done']} |")
    short = [
        f"{n} ({x['characters']:,} of {x['target']:,})" for n, x in s["data"].items() if x["short"]
    ]
    if short:
        lines += ["", f"Sources that ran out before their target (characters): {', '.join(short)}."]
    lines += _eval_lines(s["eval"]) + _export_lines(s["exports"])
    return "\n".join(lines) + "\n"


def write_summary(r) -> dict:
    s = summary(r)
    atomic_write_json(r.plan.out / "summary.json", s)
    text = markdown(s)
    atomic_write_bytes(r.plan.out / "summary.md", text.encode("utf-8"))
    r.log(text)
    return s
