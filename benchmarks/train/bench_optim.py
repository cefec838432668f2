"""Optimizer benchmark on ../shared/data: AdamW against Muon, same data order, same tokens.

AdamW (the `small` preset's tuned settings) against Muon on the hidden matrices
(train/optim.py).

Every run is the `small` preset scaled to a shared 2-core CPU (see SCALE: a smaller model,
a 2,048-token tokenizer trained here on the train split, shorter sequences, fewer steps), built
by train/build.py and stepped by train/step.py's train_step, as `fit` does. Held-out Bangla
and English bits/char (the validation files of splits.json) are scored along the way. Runs:
- adamw: the preset's AdamW settings (lr 2e-3, wd 0.1, WSD with decay_fraction 0.3);
- muon-lr*: Muon for the hidden matrices at a few muon_lr (the sweep), AdamW for the rest;
- the best Muon at shorter horizons (0.5x, 0.75x the tokens: with a decaying schedule, the
  tokens Muon needs are those of the shortest run whose final model reaches AdamW's final);
- both at a longer cool-down (decay_fraction 0.6);
- throughput: AdamW and Muon steps alternated in one process, with the machine's load.
With --ramps F...: instead, the batch-size ramp (batch_ramp_fraction) on Muon: each step's rows
in --ramp-accum micro-batches, ramps F against none at several seeds (ramp_runs), written to
optim_ramp_small<tag>_cpu-<class>.{json,md}.

Writes benchmarks/results/optim_small<tag>_cpu-<class>.{json,md,png}. Two scales were run:
`nice -n 10 python -m benchmarks.train.bench_optim --threads 1` (the default: 1M parameters, 512
tokens a step, 100 steps; a few minutes on a quiet machine) and, as `--tag=-mid`,
`--vocab 8192 --set model.hidden_size=256 --set model.intermediate_size=704 --set seq_len=128
--set batch_size=16 --set warmup_steps=20 --steps 200 --evals 8 --eval-chars 20000` (5M
parameters, 2,048 tokens a step). Runs are cached in --work, so `--runs NAME...` lets several
processes share the work (one thread each: two threads on a loaded 2-core machine stall
each other) and a last call writes the report.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
import time
from datetime import date
from pathlib import Path

import torch

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import parser, publish
from benchmarks.train.bench_train import setup
from doel.train.build import build_parts
from doel.train.config import load_config
from doel.train.loop import batches_on
from doel.train.settings import TrainConfig
from doel.train.step import lr_at, micro_batches_per_update, take_step, train_step

RESULTS = (
    "optim_small<tag>_cpu-<class>",
    "optim_ramp_small<tag>_cpu-<class>",
)  # in benchmarks/results/

ROOT = Path(__file__).resolve().parents[2]

# The `small` preset scaled down to what a 2-core CPU shared with five other jobs could train
# in ~45 minutes (about 4 GFLOP a step; the machine gave this job ~1 GFLOP/s): the
# architecture's shape kept (GQA 2:1, tied embedding), every size smaller.
VOCAB = 2048
SCALE = [
    f"model.vocab_size={VOCAB}",
    "model.hidden_size=128",
    "model.intermediate_size=352",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "seq_len=64",
    "batch_size=8",
    "warmup_steps=10",
    "compile=false",
    "optimizer=adamw",  # the preset's own choice may change; muon runs set it back
    "eval_every=0",
    "checkpoint_every=0",
]
MUON = ["optimizer=muon"]


EXTRA: list[str] = []  # --set: overrides of SCALE (another scale of the same benchmark)


def config(steps: int, sets: list[str]) -> TrainConfig:
    return load_config(
        TrainConfig, ROOT / "configs" / "small.toml", [*SCALE, *EXTRA, f"steps={steps}", *sets]
    )


# ---------------------------------------------------------------- data


class HeldOut:
    """The validation files of each language, encoded once, scored in bits/char."""

    def __init__(self, tok: Path, val: dict, max_chars: int, seq_len: int):
        from doel.train.data.tokenizer import load_tokenizer
        from doel.train.evals.heldout import encode_texts, read_texts

        tokenizer = load_tokenizer(tok)
        self.seq_len = seq_len
        self.docs = {
            lang: encode_texts(tokenizer, read_texts(paths, max_chars))
            for lang, paths in val.items()
        }

    def score(self, model) -> dict[str, float]:
        from doel.train.evals.heldout import doc_figures

        return {
            lang: doc_figures(model, texts, docs, self.seq_len, batch_size=16)["bits_per_char"]
            for lang, (texts, docs) in self.docs.items()
        }


# ---------------------------------------------------------------- runs


def busy_cpu_seconds() -> float:
    """Busy CPU time of the whole machine so far (user + nice + system), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[:3]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def train_run(name: str, cfg: TrainConfig, shards: Path, held: HeldOut, evals: int) -> dict:
    """Train cfg as `fit` does (build_parts, take_step with the batch ramp, lr_at) and score the
    held-out text at `evals` evenly spaced steps (the last one included)."""
    run = build_parts(cfg, shards, log=lambda s: None)
    marks = {round(cfg.steps * (i + 1) / evals) for i in range(evals)}
    curve, t_train, busy0, own0 = [], 0.0, busy_cpu_seconds(), own_cpu_seconds()
    updates = 0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        batches = batches_on(run.loader, run.device, cfg.grad_accum)
        per_update = micro_batches_per_update(step, cfg)
        lr = lr_at(step, cfg)
        out = take_step(
            run.compiled, run.optimizer, batches, per_update, lr, cfg.grad_clip, run.ctx
        )
        loss, updates = float(out["loss"]), updates + out["updates"]
        t_train += time.perf_counter() - t0
        if not math.isfinite(loss):
            print(f"  {name}: non-finite loss at step {step + 1}", flush=True)
            break
        if step + 1 in marks:
            bpc = held.score(run.model)
            row = {"step": step + 1, "tokens": (step + 1) * cfg.tokens_per_step}
            row |= {"seconds": t_train, "train_loss": loss, "bn": bpc["bn"], "en": bpc["en"]}
            curve.append(row)
            print(
                f"  {name} step {step + 1}/{cfg.steps}: loss {loss:.3f}, bn {bpc['bn']:.3f}, "
                f"en {bpc['en']:.3f} bits/char, {t_train:.0f} s",
                flush=True,
            )
    others = busy_cpu_seconds() - busy0 - (own_cpu_seconds() - own0)
    return {
        "name": name,
        "steps": cfg.steps,
        "curve": curve,
        "updates": updates,
        "seconds": t_train,
        "other_cpu_seconds": max(0.0, others),
        "config": _sets(cfg),
    }


def _sets(cfg: TrainConfig) -> dict:
    keys = (
        "optimizer",
        "lr",
        "muon_lr",
        "muon_weight_decay",
        "muon_adjust_lr",
        "decay_fraction",
        "steps",
        "batch_size",
        "grad_accum",
        "batch_ramp_fraction",
        "seed",
        "seq_len",
        "weight_decay",
        "warmup_steps",
    )
    return {k: getattr(cfg, k) for k in keys}


def cached(work: Path, name: str, fn) -> dict:
    path = work / "runs" / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    result = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))  # a cache for this script, not a report
    return result


def run_or_reuse(args, runs: dict, name: str, steps: int, sets: list, shards, held) -> None:
    """Train run `name` into `runs` (cached in --work); with --runs not naming it, only take
    its cached result, if any."""
    if args.runs is not None and name not in args.runs:
        path = args.work / "runs" / f"{name}.json"
        if path.is_file():
            runs[name] = json.loads(path.read_text())
        return
    print(f"{name}: {steps} steps, {' '.join(sets) or 'preset'}", flush=True)
    runs[name] = cached(
        args.work, name, lambda: train_run(name, config(steps, sets), shards, held, args.evals)
    )


def throughput(shards: Path, steps: int, rounds: int, block: int) -> dict:
    """AdamW and Muon steps alternated in one process, `rounds` blocks of `block` steps each
    (after one warm-up block), so both see the same machine load."""
    runs = {
        "adamw": build_parts(config(steps, []), shards, log=lambda s: None),
        "muon": build_parts(config(steps, MUON), shards, log=lambda s: None),
    }
    times = {k: [] for k in runs}
    others = {k: 0.0 for k in runs}
    for r in range(rounds + 1):
        for name, run in runs.items():
            busy0, own0, t0 = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
            for _ in range(block):
                batches = batches_on(run.loader, run.device, run.cfg.grad_accum)
                out = train_step(run.compiled, run.optimizer, batches, 1e-3, 1.0, run.ctx)
            float(out["loss"])
            dt = time.perf_counter() - t0
            if r:  # round 0 warms up
                times[name].append(dt)
                others[name] += busy_cpu_seconds() - busy0 - (own_cpu_seconds() - own0)
    tps = config(steps, []).tokens_per_step
    rate = {k: block * tps * len(v) / sum(v) for k, v in times.items()}
    return {
        "tokens_per_s": rate,
        "block_seconds": times,
        "other_cpu_seconds": {k: max(0.0, v) for k, v in others.items()},
        "wall_seconds": {k: sum(v) for k, v in times.items()},
        "muon_over_adamw": rate["muon"] / rate["adamw"],
    }


# ---------------------------------------------------------------- analysis


def hidden_shapes(m) -> list[tuple[int, int]]:
    """(rows, cols) of each matrix Muon takes: q, k, v, o, gate, up, down in every block."""
    kv = m.num_key_value_heads * (m.hidden_size // m.num_attention_heads)
    h, i = m.hidden_size, m.intermediate_size
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * m.num_hidden_layers


def newton_schulz_overhead(cfg: TrainConfig, ns_steps: int = 5) -> dict:
    """Muon's extra FLOPs a step (5 Newton-Schulz iterations a matrix: XXᵀ, A², BX, i.e.
    4n²m + 2n³ with n <= m) over the step's training FLOPs (6 a matmul weight a token, head
    included, plus 6·L·h·T of causal attention, as the run's log counts them)."""
    m = cfg.model
    shapes = hidden_shapes(m)
    ns = ns_steps * sum(4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3 for a, b in shapes)
    weights = sum(a * b for a, b in shapes) + m.vocab_size * m.hidden_size
    per_token = 6 * weights + 6 * m.num_hidden_layers * m.hidden_size * cfg.seq_len
    train = per_token * cfg.tokens_per_step
    return {"ns_flops_per_step": ns, "train_flops_per_step": train, "overhead": ns / train}


def final(run: dict, lang: str = "bn") -> float:
    return run["curve"][-1][lang] if run["curve"] else float("nan")


def first_reaching(run: dict, target: float) -> int | None:
    """Tokens at the first scored step whose Bangla bits/char is at or under target (linear
    between scored steps), or None."""
    prev = None
    for row in run["curve"]:
        if row["bn"] <= target:
            if prev is None:
                return row["tokens"]
            f = (prev["bn"] - target) / (prev["bn"] - row["bn"])
            return round(prev["tokens"] + f * (row["tokens"] - prev["tokens"]))
        prev = row
    return None


def tokens_to_target(horizons: dict[float, dict], target: float, full_tokens: int) -> dict:
    """Muon's tokens to AdamW's final Bangla bits/char: the shortest horizon whose final model
    reaches it (each horizon has its own full schedule), else interpolated between horizons
    on final bits/char; and, as a lower bound, where the full run's curve first reaches it."""
    pts = sorted((f * full_tokens, final(r)) for f, r in horizons.items())
    reached = [t for t, b in pts if b <= target]
    est = None
    for (t0, b0), (t1, b1) in zip(pts, pts[1:]):
        if b0 > target >= b1:
            est = t0 + (b0 - target) / (b0 - b1) * (t1 - t0)
            break
    if est is None and reached:
        est = min(reached)  # already reached at the shortest horizon: at most that
    return {
        "finals_by_tokens": pts,
        "shortest_horizon_reaching": min(reached) if reached else None,
        "interpolated_tokens": est,
        "ratio": est / full_tokens if est else None,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=Path("/tmp/doel-bench-optim-2048"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--evals", type=int, default=6, help="held-out scores a run")
    p.add_argument("--eval-chars", type=int, default=8_000, help="per language")
    p.add_argument("--muon-lrs", type=float, nargs="*", default=[0.0025, 0.005, 0.01, 0.02, 0.04])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--horizons", type=float, nargs="*", default=[0.5, 0.75], help="fractions of --steps"
    )
    p.add_argument(
        "--runs",
        nargs="*",
        help="only these runs (names as in the table; runs are cached in "
        "--work, so several processes can share the work, and a last call writes the report)",
    )
    p.add_argument("--speed-rounds", type=int, default=3, help="alternating timing blocks")
    p.add_argument(
        "--no-cooldown", dest="cooldown", action="store_false", help="skip the decay 0.6 runs"
    )
    p.add_argument("--speed-block", type=int, default=5, help="steps a timing block")
    p.add_argument("--vocab", type=int, default=VOCAB, help="tokenizer size (and the model's)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE over SCALE")
    p.add_argument("--tag", default="", help="appended to the result files' name")
    p.add_argument(
        "--ramps",
        type=float,
        nargs="*",
        help="instead of the optimizers: Muon at these batch_ramp_fraction values against none "
        "(see ramp_runs)",
    )
    p.add_argument("--ramp-accum", type=int, default=4, help="micro-batches a step (ramp runs)")
    p.add_argument("--ramp-seeds", type=int, nargs="*", default=[0, 1], help="seeds (ramp runs)")
    args = p.parse_args()
    if not (args.data / "splits.json").is_file():
        sys.exit(f"no {args.data}/splits.json: point --data at the shared data folder")
    torch.set_num_threads(args.threads)
    EXTRA[:] = [f"model.vocab_size={args.vocab}", *args.sets]
    args.work.mkdir(parents=True, exist_ok=True)
    tok, shards, val = setup(args.data, args.work, vocab=args.vocab)
    held = HeldOut(tok, val, args.eval_chars, config(args.steps, []).seq_len)
    n = args.steps
    runs = {}
    if args.ramps is not None:
        ramp_runs(args, shards, held)
        return

    def go(name, steps, sets):
        run_or_reuse(args, runs, name, steps, sets, shards, held)

    go("adamw", n, [])
    for lr in args.muon_lrs:
        go(f"muon-lr{lr:g}", n, [*MUON, f"muon_lr={lr}"])
    if args.runs is not None and not all(f"muon-lr{lr:g}" in runs for lr in args.muon_lrs):
        return
    sweep = {lr: runs[f"muon-lr{lr:g}"] for lr in args.muon_lrs}
    best_lr = min(sweep, key=lambda lr: final(sweep[lr]))
    best = [*MUON, f"muon_lr={best_lr}"]
    for frac in args.horizons:
        go(f"muon-best-x{frac:g}", round(n * frac), best)
    if args.runs is None or "throughput" in args.runs:
        print("throughput (alternating)", flush=True)
        speed = cached(
            args.work,
            "throughput",
            lambda: throughput(shards, n, args.speed_rounds, args.speed_block),
        )
        write(args.out, summarise(args, runs, speed, best_lr))  # a report now, cool-down later
    if args.cooldown:
        go("adamw-decay0.6", n, ["decay_fraction=0.6"])
        go("muon-best-decay0.6", n, [*best, "decay_fraction=0.6"])
        if (args.work / "runs" / "throughput.json").is_file():
            speed = json.loads((args.work / "runs" / "throughput.json").read_text())
            write(args.out, summarise(args, runs, speed, best_lr))


# ---------------------------------------------------------------- batch-size ramp


def ramp_runs(args, shards: Path, held: HeldOut) -> None:
    """Muon (the preset's muon_lr) with each step's rows in --ramp-accum micro-batches, at
    batch_ramp_fraction 0 and each of --ramps, at every --ramp-seeds seed (the seed draws the
    initial weights and the data order: the no-ramp runs at two seeds are the run-to-run
    noise). Same steps, tokens and data order within a seed. Writes optim_ramp_small<tag>."""
    rows = config(args.steps, []).batch_size  # SCALE's rows a step, as the optimizer runs
    if rows % args.ramp_accum:
        sys.exit(f"--ramp-accum {args.ramp_accum} must divide the {rows} rows a step")
    split = [*MUON, f"batch_size={rows // args.ramp_accum}", f"grad_accum={args.ramp_accum}"]
    runs = {}
    for seed in args.ramp_seeds:
        for frac in [0.0, *args.ramps]:
            name = f"muon-ramp{frac:g}-seed{seed}"
            sets = [*split, f"batch_ramp_fraction={frac}", f"seed={seed}"]
            run_or_reuse(args, runs, name, args.steps, sets, shards, held)
    rep = {
        "date": str(date.today()),
        "machine": _machine(args),
        "tag": args.tag,
        "scale": {
            "sets_over_small": [*SCALE, *EXTRA, *split],
            "steps": args.steps,
            "tokens_per_step": config(args.steps, split).tokens_per_step,
            "eval_chars_per_language": args.eval_chars,
        },
        "runs": runs,
        "ramps": args.ramps,
        "seeds": args.ramp_seeds,
        **ramp_verdict(runs, args.ramps, args.ramp_seeds),
    }
    name = f"optim_ramp_small{args.tag}_cpu-{rep['machine']['cpu'].get('class', 'cpu')}"
    publish(args.out, name, rep, ramp_markdown(rep), echo=False)
    print(f"wrote {args.out / name}.json, .md", flush=True)


def ramp_verdict(runs: dict, ramps: list[float], seeds: list[int]) -> dict:
    """Each ramp's final Bangla bits/char minus no ramp's at the same seed, against the noise
    (the spread of the no-ramp runs over seeds): a ramp helps only if it is lower by more than
    the noise at every seed measured."""
    base = {s: final(runs[f"muon-ramp0-seed{s}"]) for s in seeds if f"muon-ramp0-seed{s}" in runs}
    noise = max(base.values()) - min(base.values()) if len(base) > 1 else None
    deltas = {
        f"{f:g}": {
            str(s): final(runs[f"muon-ramp{f:g}-seed{s}"]) - base[s]
            for s in base
            if f"muon-ramp{f:g}-seed{s}" in runs
        }
        for f in ramps
    }
    helps = [
        f
        for f, d in deltas.items()
        if d and noise is not None and all(v < -noise for v in d.values())
    ]
    best = min(helps, key=lambda f: max(deltas[f].values())) if helps else None
    return {
        "no_ramp_final_bn": base,
        "noise_bn": noise,
        "delta_bn_vs_no_ramp": deltas,
        "ramps_that_help": helps,
        "choice_by_this_measurement": float(best) if best else 0.0,
    }


def ramp_markdown(rep: dict) -> str:
    m, sc = rep["machine"], rep["scale"]
    lines = [
        f"# Batch-size ramp: Muon, `small` scaled to a CPU ({rep['date']})",
        "",
        f"CPU: {m['cpu'].get('model_name', '?')} (class {m['cpu'].get('class', '?')}), "
        f"{m['cores']} cores shared with other jobs, {m['threads']} threads, torch {m['torch']}. "
        f"Scale (over configs/small.toml): {' '.join(sc['sets_over_small'])}; {sc['steps']} "
        f"steps of {sc['tokens_per_step']:,} tokens. Within a seed: same shards, data order and "
        "tokens; the ramp only splits its first steps into more, smaller optimizer updates "
        "(batch_ramp_fraction, train/step.py). Held-out bits/char on the first "
        f"{sc['eval_chars_per_language']:,} characters of each language's validation files.",
        "",
        "| run | seed | batch_ramp_fraction | optimizer updates | bn bits/char | en bits/char | "
        "train s | other CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rep["runs"].items():
        c = r["config"]
        lines.append(
            f"| {name} | {c['seed']} | {c['batch_ramp_fraction']:g} | {r['updates']} | "
            f"{final(r):.3f} | {final(r, 'en'):.3f} | {r['seconds']:.0f} | "
            f"{r['other_cpu_seconds']:.0f} |"
        )
    names = list(rep["runs"])
    lines += [
        "",
        "train s: each run's own wall time, on a machine shared with other jobs (other CPU s), "
        "so not a speed comparison; a ramp's extra optimizer updates each cost Muon's "
        "Newton-Schulz (see the optimizer results for its share of a step at each scale).",
        "",
        "Held-out Bangla bits/char at equal steps (equal tokens):",
        "",
    ]
    lines += ["| step | tokens | " + " | ".join(names) + " |"]
    lines += ["|---:|---:|" + "---:|" * len(names)]
    curves = [rep["runs"][n]["curve"] for n in names]
    for rows in zip(*curves):
        lines.append(
            f"| {rows[0]['step']} | {rows[0]['tokens']:,} | "
            + " | ".join(f"{r['bn']:.3f}" for r in rows)
            + " |"
        )
    noise = rep["noise_bn"]
    lines += [
        "",
        "Noise (no ramp, spread over seeds): "
        + (f"{noise:.3f} bits/char" if noise is not None else "n/a (one seed)")
        + ". Final bn minus no ramp's, same seed: "
        + "; ".join(
            f"ramp {f}: " + ", ".join(f"seed {s} {d:+.3f}" for s, d in ds.items())
            for f, ds in rep["delta_bn_vs_no_ramp"].items()
        )
        + ".",
        "",
        "Ramps lower by more than the noise at every seed: "
        + (", ".join(rep["ramps_that_help"]) or "none")
        + f". This measurement alone would choose batch_ramp_fraction = "
        f"{rep['choice_by_this_measurement']:g}.",
        "",
    ]
    return "\n".join(lines)


def _machine(args) -> dict:
    return {
        "cpu": this_cpu(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
    }


def summarise(args, runs: dict, speed: dict, best_lr: float) -> dict:
    n = args.steps
    full_tokens = runs["adamw"]["curve"][-1]["tokens"]
    target = final(runs["adamw"])
    horizons = {f: runs[f"muon-best-x{f:g}"] for f in args.horizons if f"muon-best-x{f:g}" in runs}
    horizons[1.0] = runs[f"muon-lr{best_lr:g}"]
    need = tokens_to_target(horizons, target, full_tokens)
    tps = speed["tokens_per_s"]
    wall = None
    if need["interpolated_tokens"]:
        wall = (need["interpolated_tokens"] / tps["muon"]) / (full_tokens / tps["adamw"])
    big = load_config(TrainConfig, ROOT / "configs" / "bangla-0.4b.toml", [])
    ns = {
        "this_scale": newton_schulz_overhead(config(n, MUON)),
        "bangla-0.4b": newton_schulz_overhead(big),
    }
    projected = None
    if need["ratio"]:  # tokens ratio x (1 + Muon's extra FLOPs at the 0.4B preset's batch)
        projected = need["ratio"] * (1 + ns["bangla-0.4b"]["overhead"])
    return {
        "date": str(date.today()),
        "machine": _machine(args),
        "tag": args.tag,
        "scale": {
            "sets_over_small": [*SCALE, *EXTRA],
            "steps": n,
            "tokens_per_step": config(n, []).tokens_per_step,
            "eval_chars_per_language": args.eval_chars,
        },
        "runs": runs,
        "best_muon_lr": best_lr,
        "adamw_final_bn": target,
        "muon_tokens_to_adamw_final_bn": need,
        "throughput": speed,
        "muon_wall_clock_over_adamw_to_same_bn": wall,
        "newton_schulz": ns,
        "projected_wall_clock_ratio_bangla_0.4b": projected,
        "goal_tokens_at_most_0.75": bool(need["ratio"] and need["ratio"] <= 0.75),
        "goal_wins_at_equal_wall_clock": bool(wall and wall < 1),
    }


def write(out: Path, rep: dict) -> None:
    name = f"optim_small{rep['tag']}_cpu-{rep['machine']['cpu'].get('class', 'cpu')}"
    publish(out, name, rep, markdown(rep), figure(rep), echo=False)
    print(f"wrote {out / name}.json, .md, .png", flush=True)


def markdown(rep: dict) -> str:
    runs, sp, need = rep["runs"], rep["throughput"], rep["muon_tokens_to_adamw_final_bn"]
    m = rep["machine"]
    lines = [
        f"# Optimizer benchmark: AdamW vs Muon, `small` scaled to a CPU ({rep['date']})",
        "",
        f"CPU: {m['cpu'].get('model_name', '?')} (class {m['cpu'].get('class', '?')}), "
        f"{m['cores']} cores shared with other jobs, {m['threads']} threads, torch {m['torch']}. "
        f"Scale (over configs/small.toml): {' '.join(rep['scale']['sets_over_small'])}; "
        f"{rep['scale']['steps']} steps of {rep['scale']['tokens_per_step']:,} tokens. "
        "Same shards, same data order, same tokens for every run; held-out bits/char on the "
        f"first {rep['scale']['eval_chars_per_language']:,} characters of each language's "
        "validation files (splits.json).",
        "",
        "| run | steps | optimizer | muon_lr | decay_fraction | bn bits/char | en bits/char | "
        "train s | other CPU s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        c = r["config"]
        lines.append(
            f"| {name} | {r['steps']} | {c['optimizer']} | "
            f"{c['muon_lr'] if c['optimizer'] == 'muon' else ''} | {c['decay_fraction']} | "
            f"{final(r):.3f} | {final(r, 'en'):.3f} | {r['seconds']:.0f} | "
            f"{r['other_cpu_seconds']:.0f} |"
        )
    lines += [
        "",
        "train s: each run's own wall time; runs shared the machine with each other and other "
        "jobs, so speed is compared only in the alternating blocks below. The muon-lr* rows are "
        "the sweep (Muon's lr with torch's 'original' shape adjustment; AdamW keeps lr 2e-3 on "
        "the embedding and norms); muon-best-x* the best at fewer tokens, each with its own "
        "full schedule.",
        "",
    ]
    cool = [(a, b) for a, b in (("adamw", "adamw-decay0.6"),) if b in runs]
    best_name = f"muon-lr{rep['best_muon_lr']:g}"
    if "muon-best-decay0.6" in runs:
        cool.append((best_name, "muon-best-decay0.6"))
    for a, b in cool:
        lines.append(
            f"- Cool-down: {a} bn {final(runs[a]):.3f} at decay_fraction "
            f"{runs[a]['config']['decay_fraction']} vs {final(runs[b]):.3f} at 0.6."
        )
    lines += ["", "Held-out bits/char at equal steps (AdamW vs the best Muon, full horizon):", ""]
    best = runs[f"muon-lr{rep['best_muon_lr']:g}"]
    lines += [
        "| step | tokens | AdamW bn | Muon bn | AdamW en | Muon en |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(runs["adamw"]["curve"], best["curve"]):
        lines.append(
            f"| {a['step']} | {a['tokens']:,} | {a['bn']:.3f} | {b['bn']:.3f} | "
            f"{a['en']:.3f} | {b['en']:.3f} |"
        )
    ratio = need["ratio"]
    wall = rep["muon_wall_clock_over_adamw_to_same_bn"]
    ns = rep["newton_schulz"]
    proj = rep["projected_wall_clock_ratio_bangla_0.4b"]
    lines += [
        "",
        f"AdamW's final Bangla bits/char: **{rep['adamw_final_bn']:.3f}**. Muon (muon_lr "
        f"{rep['best_muon_lr']:g}) final bn bits/char at "
        + " / ".join(f"{t:,.0f}" for t, _ in need["finals_by_tokens"])
        + " tokens: "
        + " / ".join(f"{b:.3f}" for _, b in need["finals_by_tokens"])
        + (f" -> tokens to reach it: **{ratio:.2f}x** AdamW's" if ratio else " -> not reached"),
        "",
        f"Throughput (alternating blocks in one process): AdamW {sp['tokens_per_s']['adamw']:,.0f}"
        f" tok/s, Muon {sp['tokens_per_s']['muon']:,.0f} tok/s (Muon/AdamW "
        f"{sp['muon_over_adamw']:.2f}); other processes took {sp['other_cpu_seconds']['adamw']:.0f}"
        f" / {sp['other_cpu_seconds']['muon']:.0f} CPU s during those blocks (of "
        f"{sp['wall_seconds']['adamw']:.0f} / {sp['wall_seconds']['muon']:.0f} s wall x "
        f"{m['cores']} cores).",
        "",
        "Wall-clock to AdamW's final bn bits/char, Muon / AdamW: "
        + (f"**{wall:.2f}**" if wall else "not reached"),
        "",
        "Muon's Newton-Schulz FLOPs over a step's training FLOPs: "
        f"{100 * ns['this_scale']['overhead']:.0f} % at this scale "
        f"({rep['scale']['tokens_per_step']:,} tokens a step), "
        f"{100 * ns['bangla-0.4b']['overhead']:.1f} % for `bangla-0.4b` (524,288 tokens a step); "
        "projected Muon / AdamW wall-clock there (the token ratio measured here x that "
        "overhead, a CPU-scale projection until a GPU run confirms it): "
        + (f"**{proj:.2f}**" if proj else "n/a"),
        "",
        f"Goals: tokens <= 0.75x: {_met(rep['goal_tokens_at_most_0.75'])}; "
        f"wins at equal wall-clock: {_met(rep['goal_wins_at_equal_wall_clock'])}.",
        "",
    ]
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def figure(rep: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, lang in zip(axes, ("bn", "en")):
        for name, r in rep["runs"].items():
            xs = [row["tokens"] / 1e6 for row in r["curve"]]
            ys = [row[lang] for row in r["curve"]]
            main = name in ("adamw", f"muon-lr{rep['best_muon_lr']:g}")
            ax.plot(
                xs,
                ys,
                marker="o" if main else None,
                lw=2 if main else 0.8,
                alpha=1 if main else 0.6,
                label=name,
            )
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel(f"held-out {lang} bits/char")
        ax.grid(alpha=0.3)
    axes[0].axhline(rep["adamw_final_bn"], color="gray", ls=":", lw=1)
    axes[1].legend(fontsize=7)
    fig.suptitle("AdamW vs Muon (hidden matrices), small scaled to CPU")
    fig.tight_layout()
    fig.set_dpi(110)
    return fig  # written by report.publish


if __name__ == "__main__":
    main()
