"""`doel-train plot`: a run's loss (train and validation) and throughput curves from its
metrics.jsonl, as one PNG. Apart from train/metrics.py so that only plotting loads matplotlib."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

from doel.train.common import DoelError  # noqa: E402
from doel.train.metrics import read_metrics  # noqa: E402


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Loss (train and validation) and throughput curves from metrics.jsonl, as one PNG."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DoelError(f"{run_dir} has no metrics.jsonl; is it a `doel-train fit` run folder?")
    rows = read_metrics(path)
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    if not train:
        raise DoelError(f"{path} holds no training steps yet")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if val:
        ax1.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], lw=1)
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
