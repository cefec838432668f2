"""GPU throughput of a preset: step time, tokens/s and MFU with the settings a real run uses.

The preset (default `bangla-0.4b`) with bf16 autocast + torch.compile (each block, as a run
compiles it) + fused AdamW. One
command, a few minutes, no data needed (random tokens: throughput does not depend on their values).

    python -m benchmarks.train.bench_gpu [--config bangla-0.4b] [--steps 30] \
        [--set batch_size=8 ...]

It runs the gradient-flow gate first (on the compiled model, as `fit` does), then times
`train_step` with CUDA synchronisation, separately reporting the forward and backward time of
one micro-batch (the backward/forward ratio is ~2 when healthy). Results go to
benchmarks/results/gpu_<preset>_<device>_<date>.{json,md}. On a machine without CUDA it runs on
the CPU (useful only to check the script).

Memory is reported twice: the peak the tensors held (allocated) and the peak the caching
allocator took from the GPU (reserved), which is what runs out. `steady_state_hours_for_2b_tokens`
is a lower bound: 2B tokens at the steady-state step time of random tokens, without the batch
ramp's extra optimizer updates, the data path, validation, checkpoints and compilation (the
recipe's projection, pipeline/budget.py, names what it adds).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import re
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from benchmarks.common.report import parser, publish
from doel.train.build import BlocksCompiled, compile_blocks
from doel.train.config import load_config, resolve_config, resolved
from doel.train.dist import autocast, resolve_device, resolve_dtype
from doel.train.gradflow import check_gradient_flow
from doel.train.metrics import format_flops, mfu, peak_flops
from doel.train.model import Llama
from doel.train.optim import build_optimizer
from doel.train.settings import TrainConfig
from doel.train.step import train_step

RESULTS_NOT_YET_RUN = ("gpu_<preset>_<device>_<date>",)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def measure(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    ctx = lambda: autocast(device, dtype)  # noqa: E731
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg.model)
    opt = build_optimizer(model, cfg, device)
    if cfg.compile:  # each block's forward, as a run compiles it (train/build.py)
        compile_blocks(model)
    fwd = BlocksCompiled(model) if cfg.compile else model
    shape = (cfg.batch_size, cfg.seq_len)
    batches = [
        (x, torch.roll(x, -1, 1))
        for x in (torch.randint(0, cfg.model.vocab_size, shape, device=device) for _ in range(4))
    ]
    t0 = time.perf_counter()

    def gate_loss(m, b):
        with ctx():
            return m(*b, reduction="sum") / b[1].numel()

    report = check_gradient_flow(fwd, batches[0], loss_fn=gate_loss)
    print(report.format(), flush=True)
    micro = [batches[i % 4] for i in range(cfg.grad_accum)]
    for _ in range(warmup):
        train_step(fwd, opt, micro, cfg.lr, cfg.grad_clip, ctx)
    sync(device)
    compile_and_warmup = time.perf_counter() - t0
    step_times = [
        timed(lambda: train_step(fwd, opt, micro, cfg.lr, cfg.grad_clip, ctx), device)
        for _ in range(steps)
    ]

    def forward_only():
        with ctx():
            loss = fwd(*batches[0], reduction="sum")
        return loss

    fwd_times, bwd_times = [], []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        loss = forward_only()
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        fwd_times.append(t1 - t)
        bwd_times.append(time.perf_counter() - t1)
        opt.zero_grad(set_to_none=True)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "gate_ok": report.ok,
        "compile_and_warmup_s": compile_and_warmup,
        "step_s_median": statistics.median(step_times),
        "step_s_all": step_times,
        "forward_s": statistics.median(fwd_times),
        "backward_s": statistics.median(bwd_times),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30
        if device.type == "cuda"
        else None,
        "model": model,
        "device_obj": device,
        "dtype_obj": dtype,
    }


def _known(x: float) -> float | None:
    return None if math.isnan(x) else x  # JSON null where the device's peak is unknown


def report(cfg: TrainConfig, m: dict, name: str) -> dict:
    model, device, dtype = m.pop("model"), m.pop("device_obj"), m.pop("dtype_obj")
    flops = model.flops_per_token(cfg.seq_len)
    peak, source = peak_flops(device, dtype)
    tps = cfg.tokens_per_step / m["step_s_median"]
    micro_tokens = cfg.batch_size * cfg.seq_len
    out = {
        "date": date.today().isoformat(),
        "preset": name,
        "host": platform.node(),
        **m,
        "parameters": model.num_parameters(),
        "tokens_per_step": cfg.tokens_per_step,
        "tokens_per_s": tps,
        "flops_per_token": flops,
        "peak_flops": peak,
        "peak_source": source,
        "mfu": _known(mfu(tps, flops["total"], peak)),
        "mfu_6n_only": _known(mfu(tps, flops["dense"], peak)),
        "forward_mfu": _known(mfu(micro_tokens / m["forward_s"], flops["total"] / 3, peak)),
        "backward_mfu": _known(mfu(micro_tokens / m["backward_s"], flops["total"] * 2 / 3, peak)),
        "backward_over_forward": m["backward_s"] / m["forward_s"],
        # a lower bound: steady state only (see the module docstring)
        "steady_state_hours_for_2b_tokens": 2e9 / tps / 3600,
        "config": resolved(cfg),
    }
    return out


def markdown(r: dict) -> str:
    pct = lambda x: f"{100 * x:.1f}%" if x is not None else "n/a"  # noqa: E731
    return (
        f"# GPU throughput: `{r['preset']}` on {r['device']} ({r['date']})\n\n"
        f"{r['parameters'] / 1e6:.1f}M parameters, {r['tokens_per_step']:,} tokens a step, "
        f"{r['dtype']}, compile={r['config']['compile']}; gate "
        f"{'passed' if r['gate_ok'] else 'FAILED'}.\n\n"
        "| step (median) | tokens/s | MFU | MFU (6N only) | forward MFU | backward MFU "
        "| backward/forward | 2B tokens, steady state | peak allocated | peak reserved |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| {r['step_s_median']:.3f} s | {r['tokens_per_s']:,.0f} | {pct(r['mfu'])} | "
        f"{pct(r['mfu_6n_only'])} | {pct(r['forward_mfu'])} | {pct(r['backward_mfu'])} | "
        f"{r['backward_over_forward']:.2f} | {r['steady_state_hours_for_2b_tokens']:.1f} h | "
        f"{r['peak_allocated_gib'] or 0:.1f} GiB | {r['peak_reserved_gib'] or 0:.1f} GiB |\n\n"
        "The 2B-token hours are a lower bound: the steady-state step alone, without the batch "
        "ramp, the data path, validation, checkpoints and compilation.\n\n"
        f"Peak {format_flops(r['peak_flops'])} ({r['peak_source']}); FLOPs/token "
        f"{r['flops_per_token']['total'] / 1e9:.3g} G "
        "(6 per matmul weight incl. the head + causal attention). Compile and warm-up took "
        f"{r['compile_and_warmup_s']:.0f} s.\n"
    )


def run_verify(cfg: TrainConfig, out: Path) -> bool:
    """The full suite on this device with the preset's settings; report in `out`."""
    import tempfile

    from benchmarks.train.bench_dist import make_shards
    from doel.train.checks.suite import run_suite

    shards = make_shards(Path(tempfile.mkdtemp(prefix="doel-verify-")))
    vocab = json.loads((shards / "meta.json").read_text())["tokenizer"]["vocab_size"]
    # The sample is small: shorter windows and batches, the preset's model, dtype and compile,
    # with the embedding at the sample tokenizer's size (a run's model and tokenizer must agree).
    cfg = dataclasses.replace(
        cfg,
        seq_len=min(cfg.seq_len, 256),
        batch_size=min(cfg.batch_size, 4),
        grad_accum=1,
        model=dataclasses.replace(cfg.model, vocab_size=vocab),
    )
    return run_suite(cfg, shards, "full", out_dir=out).ok


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--config", default="bangla-0.4b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[])
    p.add_argument(
        "--verify",
        action="store_true",
        help="also run the whole verification suite (on shards of the built-in sample)",
    )
    args = p.parse_args()
    cfg = load_config(TrainConfig, resolve_config(args.config), args.set)
    r = report(cfg, measure(cfg, args.steps, args.warmup), args.config)
    slug = re.sub(r"[^a-z0-9]+", "-", r["device"].lower()).strip("-")
    stem = args.out / f"gpu_{args.config}_{slug}_{r['date']}"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.verify:
        r["verify_ok"] = run_verify(cfg, stem.with_name(stem.name.replace("gpu_", "verify_", 1)))
    publish(args.out, stem.name, r, markdown(r))


if __name__ == "__main__":
    main()
