"""Throughput accounting and run logs: device peak FLOP/s, MFU, `metrics.jsonl` (its PNG curves
are train/plot.py).

MFU here is model FLOPs (the formula in `Llama.flops_per_token`, printed at the start of every
run) over the device's dense peak for the compute dtype. GPU peaks come from the vendors' data
sheets (dense, no sparsity: the 2x "with sparsity" figures made other trainers report MFU over
100 %); a CPU's peak is measured here with one large matmul, so a CPU MFU is "share of what
this CPU's BLAS reaches", not of a theoretical figure.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

# Dense bf16/fp16 tensor-core peaks, FLOP/s. fp32 runs use TF32 on these (half the bf16 peak).
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """Look a CUDA device name up in the table (longest matching key wins)."""
    for key in sorted(GPU_PEAK_BF16, key=len, reverse=True):
        if all(part in name for part in key.split()):
            peak = GPU_PEAK_BF16[key]
            return peak if dtype in (torch.bfloat16, torch.float16) else peak / 2
    return None


@functools.lru_cache(maxsize=4)
def cpu_peak_flops(dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """Measured: the best of a few n×n matmuls in `dtype` on this CPU's threads."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up (thread pool, oneDNN kernel selection)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype)
        return peak, f"{name}, data sheet" if peak else f"{name}: not in the peak table"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return cpu_peak_flops(dtype), f"CPU, measured {dtype} matmul on {threads} threads"
    return None, f"{device.type}: unknown peak"


def format_flops(flops: float | None) -> str:
    """FLOP/s in the unit that keeps three significant figures: a CPU's 43 GFLOP/s is not
    "0.0 TFLOP/s". "unknown" where there is no figure (a GPU not in the table)."""
    if not flops or flops != flops:
        return "unknown"
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP/s"


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int = 1) -> float:
    """Model FLOPs utilisation: the model FLOPs each device does a second (`tokens_per_s` is
    shared by `devices`) over one device's peak; NaN where the peak is unknown."""
    if not peak:
        return float("nan")
    return tokens_per_s / devices * flops_per_token / peak


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLog:
    """Appends one JSON object a line to RUN_DIR/metrics.jsonl (flushed each line, so a killed
    run keeps its history; a resumed run appends after dropping rows past its checkpoint).

    Training time is paid by every attempt, the work a resume redoes included, so it is kept
    apart from the rows a resume drops: train rows carry `seconds`, the training time of every
    attempt so far, and a resume leaves a {"kind": "resume"} row with the total until then
    (`earlier_seconds`) and the number of the attempt starting (`attempt`). A kill loses only
    the time since the last logged row."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.earlier_seconds, self.attempt = 0.0, 1
        if resume_step is not None and self.path.exists():
            rows = read_metrics(self.path)
            self.earlier_seconds = max((r.get("seconds", 0.0) for r in rows), default=0.0)
            self.attempt = 2 + sum(r.get("kind") == "resume" for r in rows)
            keep = [r for r in rows if r.get("step", 0) <= resume_step]
            keep.append(
                {
                    "kind": "resume",
                    "step": resume_step,
                    "attempt": self.attempt,
                    "seconds": self.earlier_seconds,
                }
            )
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: skip it
                continue
    return rows
