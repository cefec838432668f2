"""The first minutes on a rented GPU, prepared: every check of the CUDA path in one command.

    python -m benchmarks.train.gpu_first_hour [--config bangla-0.4b] [--out DIR]
    python -m benchmarks.train.gpu_first_hour --cpu   # the same parts, tiny, on this CPU

Doel's GPU path was written and tested on CPUs only (issue 56). This runs, in about ten minutes
on one H100, what a first GPU hour must confirm before anyone pays for a real run, each part
apart so that one failure does not hide the others:

1. `bench`: benchmarks/train/bench_gpu.py with TORCH_LOGS=recompiles,graph_breaks (step time,
   MFU, allocated and reserved memory; the recompiles and graph breaks counted from its log),
   each block compiled as a run compiles it (train/build.py).
2. `verify`: `doel-train verify --full` at the preset's batch, on shards of the built-in sample.
3. `flash_step`: one forward and backward of the eager model at the preset's micro-batch with
   SDPA forced to the flash kernel (grouped KV heads), or the error that says why not.
4. `optimizer_step`: the optimizer step alone, timed (our batched Muon), against torch.optim.Muon
   one matrix at a time on the same matrices: the ratio is the launch overhead saved.
5. `muon_lr_sweep`: three muon_lr values (half, the preset's, double) for `sweep_steps` steps
   each on the sample shards, eager, one micro-batch a step; the preset's value came from a
   5M-parameter CPU sweep whose best was the edge of its grid.
6. `ddp`, `fsdp`: `doel-train fit` under torchrun with 2 processes for `dist_steps` steps, then
   the last checkpoint's step deleted and the run resumed: the resumed final weights must equal
   the uninterrupted ones. With fewer than 2 GPUs they run on the CPU (gloo) at tiny size.

With `--cpu` every part runs on the CPU at the tiny preset and small step counts (CI runs it:
tests/benchmarks/train/test_gpu_first_hour.py), so the script's first GPU run is not its first
run. Results: benchmarks/results/gpu_first_hour_<device>_<date>.{json,md}, one row a part.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common.report import ROOT, command, heading, parser, publish, stamp

RESULTS_NOT_YET_RUN = ("gpu_first_hour_<device>_<date>",)

# Step counts on a GPU and with --cpu.
SIZES = {
    "gpu": {"bench_steps": 10, "sweep_steps": 100, "dist_steps": 30, "opt_reps": 10, "copies": 12},
    "cpu": {"bench_steps": 2, "sweep_steps": 6, "dist_steps": 4, "opt_reps": 2, "copies": 2},
}


def _run(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 900) -> str:
    """Run a command from the repository root, its output in `log`; raise on failure."""
    proc = subprocess.run(
        cmd, cwd=ROOT, env=os.environ | (env or {}), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    log.write_text(text, encoding="utf-8")
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {text.strip()[-600:]}")
    return text


def _doel_train(*args) -> list[str]:
    return [sys.executable, "-m", "doel.train", *map(str, args)]


def make_shards(work: Path, copies: int) -> Path:
    """Shards of the built-in sample for windows of 2048 tokens: `copies` documents a language,
    each the sample's lines in another order (the sample itself holds fewer windows of 2048
    than one 16-row batch; reordered, no window repeats another). Its own 4,096-token BPE."""
    import random

    from doel.train.data.prepare import PrepareConfig, prepare
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    corpus, rng = work / "corpus", random.Random(0)
    corpus.mkdir(parents=True, exist_ok=True)
    for lang in ("bn", "en"):
        lines = (ROOT / "train" / "sample" / f"{lang}.txt").read_text("utf-8").split("\n")
        lines = [line for line in lines if line.strip()]
        docs = [" ".join(rng.sample(lines, len(lines))) for _ in range(copies)]
        (corpus / f"{lang}.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    sample = [str(corpus / "bn.txt"), str(corpus / "en.txt")]
    tok = train_tokenizer(
        resolve_sources(sample), TokenizerConfig(vocab_size=4096), work / "tok", progress=False
    )
    prepare(tok, sample, work / "shards", PrepareConfig(), progress=False, log=lambda *a: None)
    return work / "shards"


def _vocab(shards: Path) -> int:
    return json.loads((shards / "meta.json").read_text())["tokenizer"]["vocab_size"]


def part_bench(ctx: dict) -> dict:
    sets = ["--set", "device=cpu"] if ctx["cpu"] else []
    text = _run(
        command("train.bench_gpu", "--config", ctx["config"], "--steps", ctx["bench_steps"],
                "--warmup", 2, "--out", ctx["work"] / "bench", *sets),
        ctx["work"] / "bench.log",
        env={"TORCH_LOGS": "recompiles,graph_breaks"},
    )  # fmt: skip
    (result,) = (ctx["work"] / "bench").glob("gpu_*.json")
    r = json.loads(result.read_text())
    keep = ("step_s_median", "tokens_per_s", "mfu", "backward_over_forward")
    keep += ("peak_allocated_gib", "peak_reserved_gib", "steady_state_hours_for_2b_tokens")
    return {k: r.get(k) for k in keep} | {
        "recompiles": len(re.findall(r"Recompiling function", text)),
        "graph_breaks": len(re.findall(r"[Gg]raph break", text)),
    }


def part_verify(ctx: dict) -> dict:
    out = ctx["work"] / "verify"
    cmd = _doel_train("verify", "--config", ctx["config"], "--data", ctx["shards"], "--full",
                      "--out", out, "--set", f"model.vocab_size={_vocab(ctx['shards'])}",
                      *ctx["device_set"])  # fmt: skip
    error = None
    try:
        _run(cmd, ctx["work"] / "verify.log")
    except RuntimeError as e:  # a failed check exits 1: its report says which
        error = str(e)[-600:]
    path = out / "verify.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    row = {
        "ok": bool(report.get("ok")),
        "checks": {c["name"]: c["status"] for c in report.get("checks", [])},
        "suite_seconds": report.get("seconds"),
    }
    return row | ({"error": error} if error else {})


def _model_and_batch(ctx: dict, *sets: str):
    from doel.train.config import load_config, resolve_config
    from doel.train.model import Llama
    from doel.train.settings import TrainConfig

    cfg = load_config(TrainConfig, resolve_config(ctx["config"]), [*ctx["device_set"][1:], *sets])
    torch.manual_seed(0)
    with torch.device(ctx["device"]):
        model = Llama(cfg.model)
    shape = (cfg.batch_size, cfg.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, device=ctx["device"])
    return cfg, model, x


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def part_flash_step(ctx: dict) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from doel.train.dist import autocast, resolve_dtype

    cfg, model, x = _model_and_batch(ctx)
    dtype = resolve_dtype(cfg.dtype, ctx["device"])
    _sync(ctx["device"])
    t = time.perf_counter()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), autocast(ctx["device"], dtype):
        loss = model(x, torch.roll(x, -1, 1))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        loss.backward()
    _sync(ctx["device"])
    return {"loss": float(loss.detach()), "seconds": time.perf_counter() - t, "dtype": str(dtype)}


def _time_steps(opt, device, reps: int) -> float:
    opt.step()  # warm-up: state allocated
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        opt.step()
    _sync(device)
    return (time.perf_counter() - t) / reps


def part_optimizer_step(ctx: dict) -> dict:
    from doel.train.optim import build_optimizer, hidden_matrices

    cfg, model, _ = _model_and_batch(ctx, "optimizer=muon")  # the preset's; tiny's is AdamW
    gen = torch.Generator(device=ctx["device"]).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=ctx["device"], generator=gen) * 1e-3
    opt = build_optimizer(model, cfg, ctx["device"])
    ours = _time_steps(opt, ctx["device"], ctx["opt_reps"])
    result = {"optimizer": cfg.optimizer, "step_s": ours}
    if cfg.optimizer == "muon":
        names = set(hidden_matrices(model))
        hidden = [p for n, p in model.named_parameters() if n in names]
        per_matrix = torch.optim.Muon(hidden, lr=cfg.muon_lr, adjust_lr_fn=cfg.muon_adjust_lr)
        muon = opt.sub("muon")
        muon_only = type(opt)([g for g in opt.param_groups if g["kind"] == "muon"])
        result |= {
            "muon_matrices": len(hidden),
            "muon_shapes": len({tuple(p.shape) for p in hidden}),
            "batched_muon_s": _time_steps(muon_only, ctx["device"], ctx["opt_reps"]),
            "torch_per_matrix_muon_s": _time_steps(per_matrix, ctx["device"], ctx["opt_reps"]),
            "muon_lr": muon.param_groups[0]["lr"],
        }
    return result


def _fit_args(ctx: dict, out: Path, steps: int, *sets: str) -> list[str]:
    every = max(1, steps // 2)
    base = [f"steps={steps}", f"checkpoint_every={every}", "eval_every=0", "log_every=1",
            "warmup_steps=1", "batch_ramp_fraction=0", "keep_checkpoints=3",
            f"model.vocab_size={_vocab(ctx['shards'])}"]  # fmt: skip
    args = ["fit", "--config", ctx["config"], "--data", ctx["shards"], "--out", out, "--fresh"]
    return [*map(str, args), *[a for s in [*base, *sets] for a in ("--set", s)]]


def _last_loss(run: Path) -> float | None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("kind") == "train"]
    return losses[-1] if losses else None


def part_muon_lr_sweep(ctx: dict) -> dict:
    """`fit` in this process (no interpreter start per value), the checks skipped: three runs
    of the same data and seed that differ only in muon_lr."""
    from doel.train.config import load_config, resolve_config
    from doel.train.fit import fit
    from doel.train.settings import TrainConfig

    preset = resolve_config(ctx["config"])
    base = load_config(TrainConfig, preset, [])
    losses = {}
    for scale in (0.5, 1.0, 2.0):
        lr = base.muon_lr * scale
        out = ctx["work"] / f"sweep-{lr:g}"
        args = _fit_args(ctx, out, ctx["sweep_steps"], "optimizer=muon", f"muon_lr={lr}",
                         "grad_accum=1", "compile=false", *ctx["device_set"][1:])  # fmt: skip
        sets = [a for a in args[args.index("--fresh") + 1 :] if a != "--set"]
        lines: list[str] = []
        fit(load_config(TrainConfig, preset, sets), ctx["shards"], out, fresh=True,
            log=lines.append, skip_verify=True)  # fmt: skip
        (ctx["work"] / f"sweep-{lr:g}.log").write_text("\n".join(lines), encoding="utf-8")
        losses[f"{lr:g}"] = _last_loss(out)
        gc.collect()  # the run's model and optimizer, before the next one's
        if ctx["device"].type == "cuda":
            torch.cuda.empty_cache()
    best = min(losses, key=lambda k: losses[k] if losses[k] is not None else float("inf"))
    return {"steps": ctx["sweep_steps"], "final_train_loss": losses, "best_muon_lr": best}


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _torchrun(ctx: dict, strategy: str) -> dict:
    gpus = torch.cuda.device_count() if not ctx["cpu"] else 0
    device = [] if gpus >= 2 else ["device=cpu"]
    config = ctx["config"] if gpus >= 2 else "tiny"
    sub = dict(ctx, config=config)
    out = ctx["work"] / f"torchrun-{strategy}"
    sets = (f"strategy={strategy}", "grad_accum=1", *device)
    fit = _fit_args(sub, out, ctx["dist_steps"], *sets)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "doel.train", *fit, "--skip-verify"]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1"}
    _run(run, ctx["work"] / f"torchrun-{strategy}.log", env)
    whole = _weights(out / "final")
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    shutil.rmtree(last)  # the last step's checkpoint gone: the rerun resumes before it
    shutil.rmtree(out / "final")
    resume = [a for a in run if a != "--fresh"]
    text = _run(resume, ctx["work"] / f"torchrun-{strategy}-resume.log", env)
    again = _weights(out / "final")
    equal = all(torch.equal(whole[k], again[k]) for k in whole)
    return {
        "where": f"{gpus} GPUs" if gpus >= 2 else "CPU, gloo (fewer than 2 GPUs here)",
        "steps": ctx["dist_steps"],
        "resumed": "resuming from" in text,
        "resumed_equals_uninterrupted": equal,
    }


def part_ddp(ctx: dict) -> dict:
    return _torchrun(ctx, "ddp")


def part_fsdp(ctx: dict) -> dict:
    return _torchrun(ctx, "fsdp")


PARTS = {
    "bench": part_bench,
    "verify": part_verify,
    "flash_step": part_flash_step,
    "optimizer_step": part_optimizer_step,
    "muon_lr_sweep": part_muon_lr_sweep,
    "ddp": part_ddp,
    "fsdp": part_fsdp,
}


def run_parts(ctx: dict, names, log=print) -> dict:
    """Each part in turn: its numbers, or the error it ended with; seconds either way."""
    results = {}
    for name in names:
        t = time.perf_counter()
        try:
            row = {"ok": True, **PARTS[name](ctx)}
        except Exception as e:  # noqa: BLE001 (one part's failure is its row, not the end)
            row = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
            (ctx["work"] / f"{name}.traceback").write_text(traceback.format_exc())
        row["seconds"] = time.perf_counter() - t
        results[name] = row
        log(f"{name}: {'ok' if row['ok'] else 'FAILED'} ({row['seconds']:.0f} s)")
    return results


def markdown(r: dict) -> str:
    lines = heading(f"First GPU hour: `{r['config']}` on {r['device']}", r)
    lines += [
        f"torch {r['torch']}, CUDA {r['cuda']}; {'--cpu (tiny, on this CPU)' if r['cpu'] else ''}"
        f" total {r['seconds']:.0f} s. One row a part (benchmarks/train/gpu_first_hour.py).",
        "",
        "| part | ok | s | numbers |",
        "|---|---|---:|---|",
    ]
    for name, row in r["parts"].items():
        nums = {k: v for k, v in row.items() if k not in ("ok", "seconds")}
        text = json.dumps(nums, default=str).replace("|", "\\|")
        lines.append(
            f"| {name} | {'yes' if row['ok'] else '**no**'} | {row['seconds']:.0f} | {text} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--config", default=None, help="preset (default bangla-0.4b; tiny with --cpu)")
    p.add_argument("--cpu", action="store_true", help="every part on this CPU, tiny")
    p.add_argument("--only", nargs="+", choices=list(PARTS), help="just these parts")
    args = p.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    work = Path(tempfile.mkdtemp(prefix="doel-gpu-first-hour-"))
    ctx = {
        "cpu": cpu,
        "config": args.config or ("tiny" if cpu else "bangla-0.4b"),
        "device": device,
        "device_set": ["--set", "device=cpu"] if cpu else ["--set", "device=cuda"],
        "work": work,
        **SIZES["cpu" if cpu else "gpu"],
    }
    t0 = time.perf_counter()
    ctx["shards"] = make_shards(work, ctx["copies"])
    parts = run_parts(ctx, args.only or list(PARTS))
    name = torch.cuda.get_device_name() if not cpu else "cpu"
    r = stamp() | {
        "config": ctx["config"],
        "cpu": cpu,
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": time.perf_counter() - t0,
        "parts": parts,
        "work": str(work),
    }
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    publish(args.out, f"gpu_first_hour_{slug}_{r['date']}", r, markdown(r))
    print(f"logs of every part: {work}")
    return 0 if all(row["ok"] for row in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
