"""What the recipe checks before it spends money: disk and memory per stage, the measured speed
of a few training steps and the projected time and cost, the user's confirmation.

`estimate_needs` is a pure function of the plan's numbers (tested); `check_stage` compares one
stage's needs with what `probe` finds (free disk under the run folder, MemAvailable from
/proc/meminfo) and stops with a message that says how much is missing and what to do.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from doel.contracts import memory
from doel.contracts.quant import QUANTS
from doel.train.build import build_parts
from doel.train.common import DoelError
from doel.train.dist import resolve_device
from doel.train.metrics import format_duration, mfu, peak_flops
from doel.train.step import micro_batches_per_update, train_step

GB = 1e9
BYTES_PER_CHAR = {"bn": 3.0}  # UTF-8: Bengali letters take 3 bytes; other languages ~1
ADAM_STATE = 8  # two fp32 moments a parameter (AdamW)
MUON_STATE = 4  # one fp32 momentum buffer a parameter (torch.optim.Muon keeps nothing else)


def hidden_matrix_count(m) -> int:
    """Parameters of the blocks' attention and MLP projections: the matrices Muon takes
    (train/optim.py's hidden_matrices); the embedding, the head and the norms are AdamW's."""
    kv = m.num_key_value_heads * (m.hidden_size // m.num_attention_heads)
    attention = 2 * m.hidden_size * (m.hidden_size + kv)  # q, o: h x h; k, v: h x kv
    mlp = 3 * m.hidden_size * m.intermediate_size  # gate, up, down
    return m.num_hidden_layers * (attention + mlp)


def parameter_count(m) -> int:
    """Parameters of the Llama in train/model.py for a ModelConfig, without building it."""
    norms = m.num_hidden_layers * 2 * m.hidden_size + m.hidden_size  # two a block, the final one
    embed = m.vocab_size * m.hidden_size
    head = 0 if m.tie_word_embeddings else embed
    return embed + head + hidden_matrix_count(m) + norms


@dataclass(frozen=True)
class Need:
    disk: float  # bytes the stage writes
    ram: float  # bytes of host memory it holds at its peak
    why: str  # the arithmetic, for the message


def estimate_needs(
    chars: dict[str, float],
    languages: dict[str, str],
    chars_per_token: float,
    vocab_size: int,
    params: int,
    keep_checkpoints: int,
    quants: dict[str, bool],
    tokenizer_chars: float,
    overlap_sample: int,
    chunk_chars: int = 50_000_000,
    muon_params: int = 0,
) -> dict[str, Need]:
    """Bytes each stage needs. chars: characters per source still to fetch; quants: {quant:
    mobile?}; muon_params: the parameters Muon trains (hidden_matrix_count with optimizer =
    "muon", 0 with AdamW), whose optimizer state is one buffer, not AdamW's two. Rough where it
    must be (the BPE trainer's memory), exact where it can be (shards are tokens x 2 or 4
    bytes, a checkpoint fp32 weights and optimizer state)."""
    total_chars = sum(chars.values())
    text = sum(c * BYTES_PER_CHAR.get(languages[n], 1.0) for n, c in chars.items()) * 1.02
    tokens = total_chars / chars_per_token
    itemsize = 2 if vocab_size <= 65536 else 4
    saved = muon_params * (ADAM_STATE - MUON_STATE)  # Muon's one buffer for AdamW's two moments
    ckpt = params * (4 + ADAM_STATE) - saved
    peak = params * 20 - saved
    # Bundle bytes a parameter: the quantization table's; model.ort is a second copy.
    exports = sum(
        params * QUANTS[q].bytes_per_param * (2 if mobile else 1) for q, mobile in quants.items()
    )
    return {
        # A chunk is held as Python strings (up to 4 bytes a character) until it is written.
        "data": Need(text, 2e8 + 4 * chunk_chars, f"{total_chars:,.0f} characters"),
        "tokenizer": Need(
            1e7, 1.0 * min(tokenizer_chars, total_chars) + 2e8, "word counts of its text"
        ),
        # The resume record keeps the kept n-gram hashes and a 16-byte digest per document
        # (about 1000 characters) on disk too, until the stage finishes.
        "shards": Need(
            tokens * itemsize + tokens * 8 / overlap_sample + total_chars / 1000 * 16,
            tokens * 8 / overlap_sample + total_chars / 1000 * 120 + 1e9,
            f"{tokens:,.0f} tokens x {itemsize} bytes + the resume record",
        ),
        "verify": Need(ckpt, peak, "one checkpoint of the resume check"),
        "train": Need(
            ckpt * (keep_checkpoints + 1) + params * 4,
            peak,
            f"{keep_checkpoints} + 1 checkpoints of {params:,} parameters x "
            f"{ckpt / params:.3g} bytes + final",
        ),
        "eval": Need(1e6, params * 8 + 1e9, "the model and its random twin"),
        "export": Need(
            exports + params * 4, params * 16, f"bundles {sorted(quants)} + a staging copy"
        ),
        "summary": Need(1e6, 1e8, "the report"),
    }


def probe(path: Path) -> tuple[float, float | None]:
    """(free bytes on the file system holding `path`, MemAvailable bytes or None)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    free = shutil.disk_usage(path).free
    ram = memory.available_bytes()  # None where not Linux: the memory check is left out
    return free, None if ram is None else float(ram)


def check_stage(stage: str, need: Need, free: float, ram: float | None, where: Path) -> None:
    if need.disk > free:
        raise DoelError(
            f"stage {stage}: needs about {need.disk / GB:,.2f} GB of disk ({need.why}) but "
            f"{where} has {free / GB:,.2f} GB free. Free space there, or pass --out on a "
            "larger disk; a rerun continues where this one stopped"
        )
    if ram is not None and need.ram > ram:
        raise DoelError(
            f"stage {stage}: needs about {need.ram / GB:,.2f} GB of memory but "
            f"{ram / GB:,.2f} GB is available. Close other programs or use a larger machine"
        )


def projection(
    steps: int, done: int, sec_per_step: float, gpus: int, price: float, nodes: int = 1
) -> dict:
    """Time and cost of the whole budget and of what is left, at `price` a GPU-hour. `gpus`
    counts the GPUs of all `nodes`: each is paid for while the job runs."""
    total, left = steps * sec_per_step, (steps - done) * sec_per_step
    return {
        "steps": steps,
        "steps_done": done,
        "sec_per_step": sec_per_step,
        "total_s": total,
        "remaining_s": left,
        "gpus": gpus,
        "nodes": nodes,
        "hourly_price": price,
        "total_usd": total / 3600 * hourly_cost(gpus, price),
        "remaining_usd": left / 3600 * hourly_cost(gpus, price),
    }


def hourly_cost(gpus: int, price: float) -> float:
    """Dollars an hour of the job: every GPU of every node, at `price` a GPU-hour (the launch
    files in recipes/ quote it for the GPUs they rent; tests/pipeline/test_recipe.py checks
    them)."""
    return gpus * price


def _over_nodes(p: dict) -> str:
    nodes = p.get("nodes", 1)
    return f" ({nodes} nodes of {p['gpus'] // nodes})" if nodes > 1 else ""


def require_answer(yes: bool, stdin=None) -> None:
    """Refuse early when nobody can answer the question (a pipe, a batch job) unless --yes."""
    if not yes and not (stdin or sys.stdin).isatty():
        raise DoelError(
            "stdin is not a terminal, so the recipe cannot ask before it spends GPU time; "
            "pass --yes to accept the projected time and cost"
        )


def confirm(question: str, yes: bool, stdin=None) -> None:
    """Ask on stdin; go on only on y/yes (or --yes)."""
    if yes:
        print(f"{question} yes (--yes)")
        return
    require_answer(yes, stdin)
    stdin = stdin or sys.stdin
    print(f"{question} [y/N] ", end="", flush=True)
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise DoelError("stopped before training (not confirmed); nothing was trained")


def measure_steps(cfg, next_batches, warmup: int, steps: int, seconds=None, log=print) -> dict:
    """Time `steps` optimizer steps (or as many as fit in `seconds`) of a fresh model built
    by `build_parts` as `fit` builds it (compiled when cfg.compile, eager where compilation
    fails), after `warmup` untimed ones (compilation, allocator). next_batches() gives one
    step's micro-batches on the device."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        first = next_batches()
        parts = build_parts(cfg, None, device=device, example_batch=first[0], log=log)
        warm_s, times = _timed(parts, first, next_batches, warmup, steps, seconds)
    except torch.OutOfMemoryError:
        raise DoelError(
            f"out of GPU memory at batch_size={cfg.batch_size} x seq_len={cfg.seq_len}: halve "
            "batch_size and double grad_accum (train.set in the recipe; same tokens a step)"
        ) from None
    result = _throughput(parts, times) | {"warmup_s": warm_s}
    del parts
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _timed(parts, first, next_batches, warmup, steps, seconds):
    """(seconds of warm-up, each timed step's seconds), on the model as fit runs it."""
    cfg, device = parts.cfg, parts.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    train_step(parts.compiled, parts.optimizer, first, cfg.lr, cfg.grad_clip, parts.ctx)
    for _ in range(warmup - 1):
        train_step(
            parts.compiled, parts.optimizer, next_batches(), cfg.lr, cfg.grad_clip, parts.ctx
        )
    sync()
    warm_s, times = time.perf_counter() - t0, []
    while len(times) < steps or (seconds and sum(times) < seconds):
        t = time.perf_counter()
        train_step(
            parts.compiled, parts.optimizer, next_batches(), cfg.lr, cfg.grad_clip, parts.ctx
        )
        sync()
        times.append(time.perf_counter() - t)
    return warm_s, times


def _throughput(parts, times: list[float]) -> dict:
    cfg, device, dtype = parts.cfg, parts.device, parts.dtype
    cuda = device.type == "cuda"
    sec = sorted(times)[len(times) // 2]  # the median: robust to a stray slow step
    peak, source = peak_flops(device, dtype)
    tps = cfg.tokens_per_step / sec
    util = mfu(tps, parts.model.flops_per_token(cfg.seq_len)["total"], peak)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "compile": cfg.compile,
        "steps_timed": len(times),
        "sec_per_step": sec,
        "tokens_per_s": tps,
        "mfu": None if math.isnan(util) else util,
        "peak_source": source,
        "parameters": parts.model.num_parameters(),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / GB if cuda else None,
        "gpu_memory_gb": torch.cuda.get_device_properties(device).total_memory / GB
        if cuda
        else None,
    }


# Muon (optimizer = "muon") reached AdamW's final held-out Bangla bits/char with this share of
# AdamW's tokens in benchmarks/results/optim_small-mid_cpu-amd-avx512-vnni.md (a 5M-parameter
# model on a CPU). A CPU-scale figure until a GPU run of bench_optim's comparison confirms it
# at 0.4B: said as a token share, never counted as hours or dollars saved.
MUON_TOKEN_RATIO = 0.44


def overheads(cfg, sec_per_step: float, params: int) -> dict:
    """What a run spends besides its measured steps: the validations (eval_batches forward
    passes of one micro-batch every eval_every steps, each a third of a micro-batch's measured
    forward and backward: estimated), and what is counted, not timed: the batch ramp's extra
    optimizer updates (each a clipping and an optimizer step) and the checkpoints (fp32
    weights and optimizer state, written every checkpoint_every steps)."""
    evals = cfg.steps // cfg.eval_every if cfg.eval_every else 0
    eval_s = evals * cfg.eval_batches * sec_per_step / cfg.grad_accum / 3
    ramp = round(cfg.batch_ramp_fraction * cfg.steps)
    extra = sum(cfg.grad_accum // micro_batches_per_update(s, cfg) - 1 for s in range(ramp))
    ckpts = cfg.steps // cfg.checkpoint_every if cfg.checkpoint_every else 0
    state = ADAM_STATE if cfg.optimizer == "adamw" else MUON_STATE  # Muon's matrices: roughly
    return {
        "validations": evals,
        "validation_s": eval_s,
        "ramp_steps": ramp,
        "ramp_extra_updates": extra,
        "checkpoints": ckpts,
        "checkpoint_gb": params * (4 + state) / GB,
    }


def format_projection(
    m: dict, p: dict, tokens: int, optimizer: str = "adamw", extra: dict | None = None
) -> str:
    """The measured steps and the projection, naming what it includes and what not (`extra`:
    `overheads`). Measured on a CPU (a dry run), the dollars are the GPU price's arithmetic on
    CPU seconds, and said to be."""
    util = f", MFU {100 * m['mfu']:.1f}%" if m["mfu"] is not None else ""
    mem = ""
    if m["peak_memory_gb"] is not None:
        mem = f", peak memory {m['peak_memory_gb']:.1f} of {m['gpu_memory_gb']:.0f} GB"
    lines = [
        f"measured {m['steps_timed']} steps on {m['device']} ({m['dtype']}, compile="
        f"{m['compile']}): {m['sec_per_step']:.3f} s a step, {m['tokens_per_s']:,.0f} tokens/s "
        f"a GPU{util}{mem}",
        f"projected: {p['steps']:,} steps for {tokens / 1e6:,.1f}M tokens = "
        f"{format_duration(p['total_s'])} of steps on {p['gpus']} GPU(s){_over_nodes(p)}, "
        f"${p['total_usd']:,.2f} at ${p['hourly_price']:.2f}/GPU-hour "
        f"(${hourly_cost(p['gpus'], p['hourly_price']):,.2f} an hour)"
        + ("" if m["device"] != "cpu" else "; measured on this CPU: not a GPU's time or price"),
    ]
    if extra:
        e = extra
        lines.append(
            f"  the time above is the steps alone, each at the measured {m['sec_per_step']:.3f} s "
            f"(full batch, steady state); validation adds about "
            f"{format_duration(e['validation_s'])} ({e['validations']} validations, forward "
            "only, estimated)"
        )
        lines.append(
            f"  not included: the batch ramp's {e['ramp_extra_updates']:,} extra optimizer "
            f"updates over its first {e['ramp_steps']:,} steps, {e['checkpoints']} checkpoints "
            f"of about {e['checkpoint_gb']:.1f} GB, compilation and the checks before step 1"
        )
    if p["steps_done"]:
        lines.append(
            f"left after the checkpoint at step {p['steps_done']:,}: "
            f"{format_duration(p['remaining_s'])}, ${p['remaining_usd']:,.2f}"
        )
    if optimizer == "muon":
        r = MUON_TOKEN_RATIO
        lines.append(
            f"with Muon: in a CPU-scale projection (a 5M-parameter model, "
            f"benchmarks/results/optim_small-mid_cpu-*.md) Muon reached AdamW's quality at "
            f"{r:.2f}x the tokens; not yet confirmed at this size on a GPU, so no saving is "
            "counted: the run trains all its steps"
        )
    return "\n".join(lines)
