"""Training benchmark on ../shared/data: doel's trainer against a plain transformers loop.

The `small` preset (22M parameters, vocabulary 32,768) trained for the same wall-clock budget
on the same shards, in the same run, by:
- doel: `doel-train fit --config small` (bf16 autocast where the CPU's bf16 is fast, compile);
- plain: `transformers.LlamaForCausalLM` with the same config, data order, optimizer settings
  and schedule, in the PyTorch loop a user would write (fp32, `model(input_ids, labels=...)`);
- plain + bf16: the same loop under `torch.autocast(bfloat16)`, to separate what autocast
  alone buys from the rest.
Each contender's step count is sized from a short calibration run so that its schedule ends
within the budget. At the end all three models are scored by the same code on the validation
split: nats/token and bits/character per language, against the random twin, xz and bzip2.

Writes benchmarks/results/train_small_cpu.{json,md,png}. Run: `make bench-train`
(`--budget SECONDS`, default 480).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from benchmarks.common.report import RESULTS_DIR, publish
from doel.train.config import load_config
from doel.train.settings import TrainConfig
from doel.train.step import lr_at

RESULTS = ("train_small_cpu", "train_small_cpu_<steps>steps")

ROOT = Path(__file__).resolve().parents[2]

CONTENDERS = ("doel", "plain", "plain-bf16")


def small_config(*sets) -> TrainConfig:
    return load_config(TrainConfig, ROOT / "configs" / "small.toml", list(sets))


# ---------------------------------------------------------------- the plain loop (a peer)


def plain_loop(data: Path, out: Path, steps: int, budget: float, bf16: bool) -> None:
    """What a user would write with transformers and PyTorch, same settings as `small`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from doel.train.data.loader import TokenLoader

    cfg = small_config(f"steps={steps}")
    torch.manual_seed(cfg.seed)
    hf_cfg = {k: v for k, v in cfg.model.to_hf().items() if k != "architectures"}
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg))
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / cfg.lr)
    loader = TokenLoader(data, "train", cfg.batch_size, cfg.seq_len, cfg.seed)
    log = open(out / "metrics.jsonl", "w")
    t0 = time.perf_counter()
    for step in range(steps):
        x, _ = loader.next_batch()
        ids = torch.from_numpy(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - t0
        row = {"kind": "train", "step": step + 1, "loss": loss.item(), "elapsed": elapsed}
        log.write(json.dumps(row) + "\n")
        log.flush()
        if elapsed > budget:
            break
    model.save_pretrained(out / "final")


# ---------------------------------------------------------------- running the contenders


def run_contender(name: str, data: Path, out: Path, steps: int, budget: float) -> dict:
    """Run one contender in its own process; returns steps done, seconds and tokens/s."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if name == "doel":
        cmd = [
            sys.executable,
            "-m",
            "doel.train",
            "fit",
            "--config",
            "small",
            "--data",
            str(data),
            "--out",
            str(out),
            "--fresh",
            "--steps",
            str(steps),
            "--set",
            f"time_limit={budget}",
            "--set",
            "optimizer=adamw",  # the plain loop's optimizer, whatever the preset's
            "--set",
            "eval_every=0",
            "--set",
            "checkpoint_every=0",
            "--set",
            "log_every=1",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.train.bench_train",
            "plain",
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            str(steps),
            "--budget",
            str(budget),
        ]
        cmd += ["--bf16"] if name == "plain-bf16" else []
    t0, busy0 = time.perf_counter(), _busy_cpu_seconds()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    # CPU seconds the whole machine was busy, minus this contender's own: what other
    # processes took from it (0 on a quiet machine).
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = ru.ru_utime + ru.ru_stime - _CHILD_CPU[0]
    _CHILD_CPU[0] = ru.ru_utime + ru.ru_stime
    others = max(0.0, _busy_cpu_seconds() - busy0 - own)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    (out / "stdout.txt").write_text(proc.stdout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    if name == "doel":  # fit logs wall time; make it relative to the first step's end
        t_first = rows[0]["time"]
        for r in rows:
            r["elapsed"] = r["time"] - t_first
    # Steady-state speed: skip the first 2 steps (compilation, allocator warm-up).
    tail = rows[2:] if len(rows) > 4 else rows
    sec_per_step = (tail[-1]["elapsed"] - tail[0]["elapsed"]) / max(1, len(tail) - 1)
    cfg = small_config()
    return {
        "steps": len(rows),
        "wall_s": wall,
        "other_processes_cpu_s": others,
        "sec_per_step": sec_per_step,
        "tokens_per_s": cfg.tokens_per_step / sec_per_step,
        "curve": rows,
        "tokens": len(rows) * cfg.tokens_per_step,
    }


_CHILD_CPU = [0.0]


def _busy_cpu_seconds() -> float:
    """Busy CPU time of the whole machine so far (user + nice + system), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system = (int(v) for v in fields[:3])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def calibrate(name, data, work) -> float:
    """Seconds per step in steady state, from a short run.

    The median step time after warm-up, not the mean: one hiccup (a recompilation, another
    process taking a core for a second) during a short run once made doel's calibration read
    2.6 s/step against a steady 1.0, so its schedule ended at half the budget.
    """
    r = run_contender(name, data, work / f"calibrate-{name}", 14, budget=1e9)
    t = [row["elapsed"] for row in r["curve"][3:]]  # after compilation and warm-up
    return statistics.median(b - a for a, b in zip(t, t[1:]))


# ---------------------------------------------------------------- data and evaluation


def setup(
    data: Path, work: Path, bangla_share: float = 0.55, vocab: int = 32768
) -> tuple[Path, Path, dict]:
    """Tokenizer (`vocab` tokens, trained on the train split) and shards; cached in `work`."""
    from benchmarks.train.bench_tokenizer import language_weights
    from doel.train.data.prepare import PrepareConfig, prepare
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    splits = json.loads((data / "splits.json").read_text())
    train = [str(data / p) for p in splits["bn"]["train"] + splits["en"]["train"]]
    val = {lang: [str(data / p) for p in splits[lang]["validation"]] for lang in ("bn", "en")}
    sources = resolve_sources(train)
    weights = language_weights(sources, len(splits["bn"]["train"]), bangla_share)
    tok = work / "tokenizer" / "tokenizer.json"
    if not tok.is_file():
        print(f"training the {vocab:,}-token tokenizer on the train split", flush=True)
        train_tokenizer(
            sources, TokenizerConfig(vocab_size=vocab), tok.parent, weights, progress=False
        )
    shards = work / "shards"
    if not (shards / "meta.json").is_file():
        print("writing shards", flush=True)
        prepare(
            tok,
            train,
            shards,
            PrepareConfig(),
            [f"{k}={v}" for k, v in weights.items()],
            progress=False,
        )
    return tok, shards, val


def evaluate_all(folders: dict[str, Path], tok: Path, val: dict, max_chars: int) -> dict:
    """The same scorer for every contender, plus the random twin and the compressors."""
    from doel.train.data.tokenizer import load_tokenizer
    from doel.train.evals.heldout import (
        bits_per_char,
        compressor_bits_per_char,
        random_twin,
        read_texts,
    )
    from doel.train.hf import load_model

    tokenizer = load_tokenizer(tok)
    texts = {lang: read_texts(paths, max_chars) for lang, paths in val.items()}
    seq_len = small_config().seq_len
    out = {"compressors": {lang: compressor_bits_per_char(t) for lang, t in texts.items()}}
    models = {name: load_model(folder) for name, folder in folders.items()}
    models["random twin"] = random_twin(models["doel"])
    torch.set_num_threads(os.cpu_count() or 1)
    for name, model in models.items():
        out[name] = {
            lang: bits_per_char(model, tokenizer, t, seq_len, batch_size=16)
            for lang, t in texts.items()
        }
        print(
            f"  {name}: "
            + ", ".join(f"{k} {v['bits_per_char']:.3f} bits/char" for k, v in out[name].items()),
            flush=True,
        )
    return out


# ---------------------------------------------------------------- report


def peaks() -> dict:
    from doel.train.metrics import cpu_peak_flops

    return {"float32": cpu_peak_flops(torch.float32), "bfloat16": cpu_peak_flops(torch.bfloat16)}


def summarise(runs: dict, scores: dict, budget: float, peak: dict) -> dict:
    from doel.train.model import Llama

    with torch.device("meta"):
        flops = Llama(small_config().model).flops_per_token(small_config().seq_len)["total"]
    rows = {}
    for name, r in runs.items():
        fps = r["tokens_per_s"] * flops
        rows[name] = {
            "steps": r["steps"],
            "other_processes_cpu_s": r["other_processes_cpu_s"],
            "wall_s": r["wall_s"],
            "tokens": r["tokens"],
            "tokens_per_s": r["tokens_per_s"],
            "model_tflops": fps / 1e12,
            "mfu_vs_fp32_peak": fps / peak["float32"],
            "mfu_vs_bf16_peak": fps / peak["bfloat16"],
            "bits_per_char": {lang: s["bits_per_char"] for lang, s in scores[name].items()},
            "nats_per_token": {lang: s["nats_per_token"] for lang, s in scores[name].items()},
        }
    bn = {n: rows[n]["bits_per_char"]["bn"] for n in rows}
    ratio = rows["doel"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "budget_seconds": budget,
        "flops_per_token": flops,
        "peak_flops_measured": peak,
        "contenders": rows,
        "random_twin_bits_per_char": {
            k: v["bits_per_char"] for k, v in scores["random twin"].items()
        },
        "compressors_bits_per_char": scores["compressors"],
        "doel_over_plain_tokens_per_s": ratio,
        "targets": {
            "tokens_per_s_at_least_1.3x_plain": ratio >= 1.3,
            "lower_bits_per_char_than_plain_in_same_time": all(
                rows["doel"]["bits_per_char"][lang] < rows["plain"]["bits_per_char"][lang]
                for lang in ("bn", "en")
            ),
            "bn_under_xz": bn["doel"] < scores["compressors"]["bn"]["xz -9e"],
            "bn_under_bzip2": bn["doel"] < scores["compressors"]["bn"]["bzip2 -9"],
        },
    }


def markdown(rep: dict) -> str:
    lines = [
        f"# Training benchmark: `small` preset, {rep['budget_seconds'] / 60:.0f} minutes each "
        f"({rep['date']}, {rep['machine']})",
        "",
        "Same shards (../shared/data train split, 32,768-token doel tokenizer, Bangla 55 % of "
        "characters), same model config, data order, AdamW settings and schedule; each run's "
        "step count sized by a calibration run to fit the budget. Validation: the "
        "validation split of splits.json, scored by the same code for every model.",
        "",
        "| trainer | steps | tokens/s | model TFLOP/s | MFU vs fp32 peak | MFU vs bf16 peak "
        "| bn bits/char | en bits/char | bn nats/token | CPU s taken by other processes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rep["contenders"].items():
        lines.append(
            f"| {name} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.3f} | "
            f"{100 * r['mfu_vs_fp32_peak']:.1f}% | {100 * r['mfu_vs_bf16_peak']:.1f}% | "
            f"{r['bits_per_char']['bn']:.3f} | {r['bits_per_char']['en']:.3f} | "
            f"{r['nats_per_token']['bn']:.3f} | {r['other_processes_cpu_s']:.0f} of "
            f"{r['wall_s'] * (os.cpu_count() or 1):.0f} |"
        )
    tw, cz = rep["random_twin_bits_per_char"], rep["compressors_bits_per_char"]
    lines.append(f"| random twin | 0 | | | | | {tw['bn']:.3f} | {tw['en']:.3f} | | |")
    for c in ("xz -9e", "bzip2 -9"):
        lines.append(f"| `{c}` | | | | | | {cz['bn'][c]:.3f} | {cz['en'][c]:.3f} | | |")
    pk = rep["peak_flops_measured"]
    lines += [
        "",
        f"doel / plain tokens/s: **{rep['doel_over_plain_tokens_per_s']:.2f}×**. "
        f"FLOPs/token {rep['flops_per_token'] / 1e6:.1f}M (6 per matmul weight incl. the head, "
        f"plus causal attention); this CPU's measured matmul peak: fp32 "
        f"{pk['float32'] / 1e12:.2f}, bf16 {pk['bfloat16'] / 1e12:.2f} TFLOP/s. The last column "
        "is the CPU time other processes on this machine took during each run (out of the run's "
        "wall time × cores): 0 means a quiet machine, and equal shares keep the ratio fair.",
        "",
        "Targets: "
        + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in rep["targets"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def figure(runs: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in runs.items():
        xs = [row["elapsed"] / 60 for row in r["curve"]]
        ys = [row["loss"] for row in r["curve"]]
        k = max(1, len(ys) // 100)  # smooth: mean over windows of k steps
        sm = [sum(ys[i : i + k]) / len(ys[i : i + k]) for i in range(0, len(ys), k)]
        ax.plot(xs[::k][: len(sm)], sm, label=f"{name} ({r['tokens_per_s']:,.0f} tok/s)")
    ax.set(
        xlabel="minutes of training",
        ylabel="training loss (nats/token)",
        title="small preset on 2 CPU cores: same budget, same data",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.set_dpi(110)
    return fig  # written by report.publish


def doel_for_steps(args, tok: Path, shards: Path, val: dict) -> None:
    """doel alone for a fixed number of steps, scored like the contenders.

    Bits/char after N steps does not depend on how busy the machine is, only the time does;
    so this mode answers the compressor targets on a shared machine. Writes
    train_small_cpu_<N>steps.{json,md}.
    """
    run = run_contender("doel", shards, args.work / "doel-steps", args.doel_steps, 1e9)
    scores = evaluate_all({"doel": args.work / "doel-steps" / "final"}, tok, val, args.eval_chars)
    comp, bn = scores["compressors"], scores["doel"]["bn"]["bits_per_char"]
    rep = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps": run["steps"],
        "tokens": run["tokens"],
        "wall_s": run["wall_s"],
        "other_processes_cpu_s": run["other_processes_cpu_s"],
        "bits_per_char": {
            n: {k: v["bits_per_char"] for k, v in s.items()}
            for n, s in scores.items()
            if n != "compressors"
        },
        "compressors_bits_per_char": comp,
        "targets": {
            "bn_under_xz": bn < comp["bn"]["xz -9e"],
            "bn_under_bzip2": bn < comp["bn"]["bzip2 -9"],
        },
    }
    name = f"train_small_cpu_{run['steps']}steps"
    rows = [f"| {n} | {b['bn']:.3f} | {b['en']:.3f} |" for n, b in rep["bits_per_char"].items()] + [
        f"| `{c}` | {comp['bn'][c]:.3f} | {comp['en'][c]:.3f} |" for c in comp["bn"]
    ]
    met = ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in rep["targets"].items())
    md = "\n".join(
        [
            f"# doel, `small` preset, {run['steps']} steps ({rep['date']}, {rep['machine']})",
            "",
            f"{run['tokens']:,} tokens; the whole schedule (warm-up, WSD decay) in "
            f"{run['wall_s']:.0f} s wall, other processes took {run['other_processes_cpu_s']:.0f}"
            " CPU s meanwhile (the time is not the point here; the steps are). Validation "
            "split of splits.json, scored as in train_small_cpu.md.",
            "",
            "| model | bn bits/char | en bits/char |",
            "|---|---:|---:|",
            *rows,
            "",
            f"Targets: {met}.",
            "",
        ]
    )
    publish(RESULTS_DIR, name, rep | {"curve": run["curve"]}, md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    pl = sub.add_parser("plain", help="(internal) run the plain transformers loop")
    for a in ("--data", "--out"):
        pl.add_argument(a, type=Path, required=True)
    pl.add_argument("--steps", type=int, required=True)
    pl.add_argument("--budget", type=float, required=True)
    pl.add_argument("--bf16", action="store_true")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/doel-bench-train"))
    p.add_argument("--budget", type=float, default=480.0, help="seconds of training each")
    p.add_argument("--bangla-share", type=float, default=0.55)
    p.add_argument("--eval-chars", type=int, default=300_000, help="per language")
    p.add_argument("--only", nargs="*", default=list(CONTENDERS))
    p.add_argument(
        "--doel-steps",
        type=int,
        help="train doel alone for N steps (no time limit) and score it against the "
        "compressors: the bits/char targets, which depend on steps, not on the clock",
    )
    args = p.parse_args()
    if args.cmd == "plain":
        return plain_loop(args.data, args.out, args.steps, args.budget, args.bf16)
    if not (args.data / "splits.json").is_file():
        sys.exit(f"no {args.data}/splits.json: point --data at the shared data folder")
    args.work.mkdir(parents=True, exist_ok=True)
    tok, shards, val = setup(args.data, args.work, args.bangla_share)
    if args.doel_steps:
        return doel_for_steps(args, tok, shards, val)
    runs = {}
    for name in args.only:
        sec = calibrate(name, shards, args.work)
        steps = max(10, int(args.budget / sec))
        print(f"{name}: {sec:.2f} s/step calibrated -> {steps} steps", flush=True)
        runs[name] = run_contender(name, shards, args.work / name, steps, args.budget)
        print(f"  {runs[name]['steps']} steps, {runs[name]['tokens_per_s']:,.0f} tok/s", flush=True)
    folders = {n: args.work / n / "final" for n in runs}
    scores = evaluate_all(folders, tok, val, args.eval_chars)
    rep = summarise(runs, scores, args.budget, peaks())
    curves = {n: r["curve"] for n, r in runs.items()}
    publish(RESULTS_DIR, "train_small_cpu", rep | {"curves": curves}, markdown(rep), figure(runs))


if __name__ == "__main__":
    main()
