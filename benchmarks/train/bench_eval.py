"""Full evaluation of a trained model on ../shared/data, and the lm-evaluation-harness cross-check.

1. Held-out bits/character per language (the validation files of splits.json) against the random
   twin and xz / bzip2, windows of the model's training seq_len.
2. Every zero-shot task in ../shared/data/eval: HellaSwag, PIQA, the llm-foundry files (ARC-E/C,
   BoolQ, COPA, OpenBookQA, CommonsenseQA, SocialIQA, WinoGrande, WSC) and the Bangla
   short-answer sets as 4-way choices (TyDi QA GoldP Bengali, BLanCK): acc and acc_norm with
   bootstrap standard errors and chance.
3. HellaSwag and PIQA again through lm-eval (its own task definitions on the same local files,
   transformers' Llama): item-by-item agreement of the verdicts and the largest log-likelihood
   difference.

Writes benchmarks/results/eval_small.{json,md} and the model card they give, eval_small_card.md.
Run: `python -m benchmarks.train.bench_eval [--model DIR] [--limits hellaswag=2000 ...]
[--crosscheck-limits hellaswag=1000 ...]`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.report import parser, publish

RESULTS = ("eval_<name>", "eval_<name>_card")

ROOT = Path(__file__).resolve().parents[2]

TASK_FILES = {
    "hellaswag": "eval/hellaswag/hellaswag_val_reconstructed.jsonl",
    "piqa": "eval/piqa",
    "arc_easy": "eval/llm_foundry/arc_easy.jsonl",
    "arc_challenge": "eval/llm_foundry/arc_challenge.jsonl",
    "boolq": "eval/llm_foundry/boolq.jsonl",
    "copa": "eval/llm_foundry/copa.jsonl",
    "openbook_qa": "eval/llm_foundry/openbook_qa.jsonl",
    "commonsense_qa": "eval/llm_foundry/commonsense_qa.jsonl",
    "siqa": "eval/llm_foundry/siqa.jsonl",
    "winogrande": "eval/llm_foundry/winogrande.jsonl",
    "winograd": "eval/llm_foundry/winograd_wsc.jsonl",
    "bn_tydiqa": "eval/bn_tydiqa_goldp/bengali_tydiqa_dev.json",
    "bn_blanck": "eval/bn_blanck/BlanCK.csv",
}
CROSSCHECK = ("piqa", "hellaswag")  # the shorter first


def limits_arg(specs: list[str]) -> dict[str, int]:
    out = {}
    for spec in specs:
        name, _, n = spec.partition("=")
        out[name] = int(n)
    return out


def held_out(folder: Path, data: Path, max_chars: int, device: str) -> dict:
    from doel.train.evals.heldout import evaluate_checkpoint

    splits = json.loads((data / "splits.json").read_text())
    val = {lang: [str(data / p) for p in splits[lang]["validation"]] for lang in ("bn", "en")}
    cfg = (
        json.loads((folder / "train_config.json").read_text())
        if (folder / "train_config.json").is_file()
        else {}
    )
    t0 = time.perf_counter()
    r = evaluate_checkpoint(
        folder, val, seq_len=cfg.get("seq_len"), max_chars=max_chars, device=device, batch_size=16
    )
    r["seconds"] = time.perf_counter() - t0
    return r


def run_tasks(folder: Path, data: Path, limits: dict, default: int | None, device: str):
    """Every task: its summary (with items available, seconds) and the per-item lls."""
    from doel.train.data.tokenizer import load_tokenizer
    from doel.train.evals.scoring import score_items, summarize
    from doel.train.evals.tasks import load_task
    from doel.train.hf import load_model

    model, tok = load_model(folder, device=device).eval(), load_tokenizer(folder)
    results, lls = {}, {}
    for name, rel in TASK_FILES.items():
        path = data / rel
        if not path.exists():
            print(f"skipping {name}: no {path}", flush=True)
            continue
        items = load_task(name, path)
        total, items = len(items), items[: limits.get(name, default)]
        t0 = time.perf_counter()
        lls[name] = score_items(model, tok, items, batch_size=32, progress=True)
        secs = time.perf_counter() - t0
        results[name] = {"path": rel, "available": total, "seconds": secs} | summarize(
            items, lls[name]
        )
        r = results[name]
        print(
            f"{name}: {r['items']}/{total} items, acc {r['acc']:.3f} ± {r['acc_stderr']:.3f}, "
            f"acc_norm {r['acc_norm']:.3f}, chance {r['chance']:.3f}, {secs:.0f}s",
            flush=True,
        )
    return results, lls


def crosscheck(folder: Path, data: Path, task: str, ours, n: int, device: str) -> dict:
    """lm-eval on the first n items; agreement with our verdicts (`ours`: our per-item lls,
    or None to score them here) item by item."""
    from doel.train.data.tokenizer import load_tokenizer
    from doel.train.evals.crosscheck import lm_eval_choices
    from doel.train.evals.scoring import predictions, score_items
    from doel.train.evals.tasks import load_task
    from doel.train.hf import load_model

    items = load_task(task, data / TASK_FILES[task], limit=n)
    if ours is None:
        model, tok = load_model(folder, device=device).eval(), load_tokenizer(folder)
        ours = score_items(model, tok, items, batch_size=32, progress=True)
    t0 = time.perf_counter()
    theirs = lm_eval_choices(folder, task, data / TASK_FILES[task], n, 32, device)
    secs = time.perf_counter() - t0
    pred, norm = predictions(items, ours[:n])
    same = [
        p == int(np.argmax(t["lls"]))
        and (p == it.gold) == bool(t["acc"])
        and (q == it.gold) == bool(t["acc_norm"])
        for p, q, it, t in zip(pred, norm, items, theirs)
    ]
    diff = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o, t["lls"]))
    return {
        "items": len(items),
        "agreement": sum(same) / len(same),
        "disagreeing_items": [i for i, s in enumerate(same) if not s],
        "max_abs_ll_diff": diff,
        "acc_ours": sum(p == it.gold for p, it in zip(pred, items)) / len(items),
        "acc_lm_eval": sum(t["acc"] for t in theirs) / len(theirs),
        "acc_norm_ours": sum(q == it.gold for q, it in zip(norm, items)) / len(items),
        "acc_norm_lm_eval": sum(t["acc_norm"] for t in theirs) / len(theirs),
        "lm_eval_seconds": secs,
    }


def model_card(folder: Path, rep: dict, meta_path: Path | None = None) -> str:
    """The card `write_model_card` writes for this model and evaluation (into a copy of the
    folder), from the run's metrics.jsonl and the shards' meta.json when they are there."""
    import shutil
    import tempfile

    from doel.train.evals.modelcard import write_model_card
    from doel.train.metrics import read_metrics

    run = folder.parent
    meta_path = meta_path or run.parent / "shards" / "meta.json"
    steps = (
        [m for m in read_metrics(run / "metrics.jsonl") if m.get("kind") == "train"]
        if (run / "metrics.jsonl").is_file()
        else []
    )
    state = {"step": steps[-1]["step"], "tokens_seen": steps[-1]["tokens"]} if steps else None
    seconds = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        copy = shutil.copytree(folder, Path(tmp) / run.name)
        card = write_model_card(
            copy,
            meta=json.loads(meta_path.read_text()) if meta_path.is_file() else None,
            train_state=state,
            eval_result={"languages": rep["held_out"]["languages"], "tasks": rep["tasks"]},
            hardware=f"{os.cpu_count()} CPU cores ({platform.machine()})",
            seconds=seconds,
        )
        return Path(card).read_text(encoding="utf-8")


def markdown(rep: dict) -> str:
    from doel.train.evals.heldout import format_eval

    lines = [
        f"# Evaluation of `{rep['model']}` ({rep['date']}, {rep['machine']}, commit "
        f"{rep['commit']})",
        "",
        format_eval(rep["held_out"]),
        "",
        "## Zero-shot tasks",
        "",
        "Log-likelihood of each choice given the context (train/evals/scoring.py); acc_norm "
        "divides by the choice's characters; ± bootstrap standard error. Bangla tasks: gold answer "
        "against 3 distractors (TyDi QA: same-length spans of the passage; BLanCK: answers of "
        "the same category). Majority: the accuracy of always picking the most frequent gold "
        "position, the score of a model that prefers one letter or one word.",
        "",
        "| task | items (of) | acc | acc_norm | chance | majority | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rep["tasks"].items():
        lines.append(
            f"| {name} | {r['items']:,} ({r['available']:,}) | {r['acc']:.3f} ± "
            f"{r['acc_stderr']:.3f} | {r['acc_norm']:.3f} ± {r['acc_norm_stderr']:.3f} "
            f"| {r['chance']:.3f} | {r.get('majority', float('nan')):.3f} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        "## Cross-check with lm-evaluation-harness " + rep["lm_eval_version"],
        "",
        "Same folder and files through lm-eval's own hellaswag/piqa task definitions "
        "(transformers LlamaForCausalLM, PreTrainedTokenizerFast). Agreement: same chosen "
        "index and the same acc and acc_norm verdict.",
        "",
        "| task | items | agreement | max abs. log-lik. diff | acc ours / lm-eval "
        "| acc_norm ours / lm-eval | lm-eval seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in rep["crosscheck"].items():
        lines.append(
            f"| {name} | {c['items']:,} | {c['agreement']:.2%} | {c['max_abs_ll_diff']:.2e} "
            f"| {c['acc_ours']:.4f} / {c['acc_lm_eval']:.4f} "
            f"| {c['acc_norm_ours']:.4f} / {c['acc_norm_lm_eval']:.4f} "
            f"| {c['lm_eval_seconds']:.0f} |"
        )
    return "\n".join(lines + ["", *(f"- {n}" for n in rep["notes"])]) + "\n"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", type=Path, default=Path("/tmp/doel-bench-train/doel/final"))
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--name", default="eval_small")
    p.add_argument("--eval-chars", type=int, default=300_000, help="held-out chars a language")
    p.add_argument("--limit", type=int, default=None, help="items a task, unless --limits")
    p.add_argument("--limits", nargs="*", default=[], metavar="TASK=N")
    p.add_argument("--crosscheck-limits", nargs="*", default=[], metavar="TASK=N")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--shards-meta", type=Path, help="for the card; default RUN/../shards/")
    p.add_argument("--crosscheck-only", action="store_true", help="keep the rest of --out's run")
    p.add_argument(
        "--crosscheck-tasks",
        nargs="*",
        default=None,
        help="with --crosscheck-only: rerun "
        "these tasks' cross-checks and keep the earlier run's others (default: all)",
    )
    args = p.parse_args()
    import lm_eval

    torch.set_num_threads(os.cpu_count() or 1)
    limits, cc_limits = limits_arg(args.limits), limits_arg(args.crosscheck_limits)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    rep = {
        "model": str(args.model),
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.device}, "
        f"torch {torch.__version__}",
        "commit": commit,
        "lm_eval_version": getattr(lm_eval, "__version__", "0.4.13"),
        "notes": args.note,
    }
    lls: dict = {}
    if args.crosscheck_only:  # the other stages as an earlier run of this script wrote them
        old = json.loads((args.out / f"{args.name}.json").read_text())
        rep |= {k: old[k] for k in ("held_out", "tasks")}
        rep["notes"] = old["notes"] + args.note
        if args.crosscheck_tasks is not None:
            rep["crosscheck"] = {
                t: c for t, c in old.get("crosscheck", {}).items() if t not in args.crosscheck_tasks
            }
    else:
        print(f"held-out bits/char on {args.data}", flush=True)
        rep["held_out"] = held_out(args.model, args.data, args.eval_chars, args.device)
        rep["tasks"], lls = run_tasks(args.model, args.data, limits, args.limit, args.device)
    rep.setdefault("crosscheck", {})
    # Written after every stage: a long run keeps what it did.
    publish(args.out, args.name, rep, markdown(rep), echo=False)
    for t in (t for t in CROSSCHECK if t in rep["tasks"] and t not in rep["crosscheck"]):
        n = cc_limits.get(t, rep["tasks"][t]["items"])
        c = crosscheck(args.model, args.data, t, lls.get(t), n, args.device)
        rep["crosscheck"][t] = c
        print(f"lm-eval {t}: {c['items']} items, agreement {c['agreement']:.2%}", flush=True)
        publish(args.out, args.name, rep, markdown(rep), echo=False)
    card = model_card(args.model, rep, args.shards_meta)
    publish(args.out, args.name, rep, markdown(rep), echo=False, beside={"_card.md": card})
    print(f"wrote {args.out / args.name}.json, .md and _card.md", flush=True)


if __name__ == "__main__":
    main()
