"""Run by tests/test_dist.py under torchrun: rank 1 hangs after step 3 (a planted hang)."""

import os
import sys
import time

from doel.train.config import load_config
from doel.train.fit import fit
from doel.train.trainer import TrainConfig


def hang(step: int) -> None:
    if os.environ.get("RANK") == "1" and step == 3:
        time.sleep(3600)


if __name__ == "__main__":
    config, data, out = sys.argv[1:4]
    cfg = load_config(TrainConfig, config, ["batch_size=2", "dist_timeout=5", "steps=20"])
    fit(cfg, data, out, step_hook=hang)
