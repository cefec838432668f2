"""What the training stage needs of torch, said in one line before anything else fails.

The floor (`MIN_TORCH`) is the oldest release that has everything the code imports:
torch.optim.Muon and its private Newton-Schulz (train/optim.py; first shipped in 2.9),
`fully_shard` and `MixedPrecisionPolicy` under torch.distributed.fsdp (2.6) and the
torch.distributed.checkpoint Hugging Face storage writer (train/checkpoint.py, 2.8).
pyproject.toml's train extra names the same floor (tests/train/test_torchcheck.py
holds them equal), so pip refuses an older torch; an image that already has one (a provider's)
is refused here, at import of train/dist.py and train/optim.py (so before a run starts), naming the
version instead of an ImportError deep in torch.

When a run asks for CUDA and torch sees none, `cuda_missing_reason` names the likely cause: a
CPU-only wheel, or a wheel built for a newer CUDA than the NVIDIA driver supports.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import torch

from doel.train.common import DoelError

MIN_TORCH = (2, 9)
NEEDS = "torch.optim.Muon, torch.distributed.fsdp.fully_shard, the DCP Hugging Face writer"


class TorchTooOld(DoelError):
    pass


def too_old(version: str) -> str | None:
    """The refusal for a torch `version` string older than MIN_TORCH, or None."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m[1]), int(m[2])) >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (
        f"torch {version} is too old: doel's training needs torch>={floor} ({NEEDS}); "
        f"pip install 'torch>={floor}' (the CUDA wheel that matches your driver: "
        "https://pytorch.org/get-started/locally/)"
    )


def require_torch(version: str | None = None) -> None:
    """Raise TorchTooOld (one line) where the installed torch is older than MIN_TORCH."""
    problem = too_old(str(torch.__version__ if version is None else version))
    if problem:
        raise TorchTooOld(problem)


def nvidia_driver() -> str | None:
    """The NVIDIA driver version nvidia-smi reports, or None (no nvidia-smi, or it fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    # nvidia-smi that fails (no GPU, no kernel module) is no driver a GPU answers through
    return lines[0].strip() if out.returncode == 0 and lines else None


def cuda_missing_reason(wheel_cuda: str | None, torch_version: str, driver: str | None) -> str:
    """Why torch sees no GPU, from the wheel's CUDA version (torch.version.cuda), torch's
    version and the driver nvidia-smi reports (None: no nvidia-smi)."""
    if wheel_cuda is None:
        return (
            f"this torch ({torch_version}) is a CPU-only build; install a CUDA wheel "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu128, or the "
            "cuXXX that your driver supports)"
        )
    if driver is None:
        return (
            f"torch {torch_version} is built for CUDA {wheel_cuda}, but no NVIDIA driver answers "
            "(nvidia-smi not found): no GPU on this machine, or its driver is not installed"
        )
    return (
        f"torch {torch_version} is built for CUDA {wheel_cuda} and the NVIDIA driver is "
        f"{driver}: a driver older than the wheel's CUDA needs (CUDA 12.8 wants >= 570, 12.6 "
        ">= 560, 12.4 >= 550), or CUDA_VISIBLE_DEVICES hides the GPU. Install the torch wheel "
        "for the driver's CUDA (nvidia-smi's header names it) or a newer driver"
    )


def cuda_unavailable_message(asked: str) -> str:
    """The one-line refusal when `asked` ("cuda", or "auto" on a machine with a driver) needs
    a GPU that torch cannot see."""
    why = cuda_missing_reason(torch.version.cuda, torch.__version__, nvidia_driver())
    more = (
        " (device=auto: pass --set device=cpu to train on the CPU anyway)"
        if asked == "auto"
        else ""
    )
    return f"device={asked} but torch sees no CUDA GPU: {why}{more}"
