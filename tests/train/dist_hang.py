"""Run by the distributed tests under torchrun, with a fault planted at a step.

`dist_hang.py CONFIG DATA OUT`: rank 1 hangs after step 3 (tests/train/test_dist.py).
`dist_hang.py pause PID_FILE CONFIG DATA OUT [KEY=VALUE...]`: on the job's first start, rank 1
writes its PID to PID_FILE after step 5 and waits for the test to kill it
(tests/train/test_multinode.py); the file, not torchrun's restart count, says it was the first
start, since each node's agent counts its own restarts.
"""

import os
import sys
import time
from pathlib import Path

from doel.train.config import load_config
from doel.train.fit import fit
from doel.train.settings import TrainConfig

PAUSE_STEP = 5


def hang(step: int) -> None:
    if os.environ.get("RANK") == "1" and step == 3:
        time.sleep(3600)


def pause_once(pid_file: Path):
    def hook(step: int) -> None:
        if os.environ.get("RANK") == "1" and step == PAUSE_STEP and not pid_file.exists():
            pid_file.write_text(str(os.getpid()), encoding="utf-8")
            time.sleep(3600)

    return hook


if __name__ == "__main__":
    if sys.argv[1] == "pause":
        pid_file, config, data, out, *sets = sys.argv[2:]
        cfg = load_config(TrainConfig, config, sets)
        fit(cfg, data, out, step_hook=pause_once(Path(pid_file)), skip_verify=True)
    else:
        config, data, out = sys.argv[1:4]
        cfg = load_config(TrainConfig, config, ["batch_size=2", "dist_timeout=5", "steps=20"])
        fit(cfg, data, out, step_hook=hang)
