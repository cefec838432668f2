"""Run by the distributed tests under torchrun, with a fault planted at a step.

`dist_hang.py CONFIG DATA OUT`: rank 1 hangs after step 3 (tests/train/test_dist.py).
`dist_hang.py pause PID_FILE CONFIG DATA OUT [KEY=VALUE...]`: on the job's first start, rank 1
writes its PID to PID_FILE after step 5 and waits for the test to kill it
(tests/train/test_multinode.py); the file, not torchrun's restart count, says it was the first
start, since each node's agent counts its own restarts.
`dist_hang.py slow-setup CONFIG DATA OUT`: rank 1 takes 8 s longer than rank 0 before step 1 (a
cold compile cache), with dist_timeout=3 and dist_setup_timeout=60: the run must finish.
"""

import os
import sys
import time
from pathlib import Path

import doel.train.build
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
    elif sys.argv[1] == "slow-setup":
        config, data, out = sys.argv[2:5]
        describe = doel.train.build.describe

        def slow_describe(*a, **kw):  # after the wrapper is built, before the checks
            if os.environ.get("RANK") == "1":
                time.sleep(8)
            return describe(*a, **kw)

        doel.train.build.describe = slow_describe
        sets = ["batch_size=2", "steps=2", "dist_timeout=3", "dist_setup_timeout=60"]
        fit(load_config(TrainConfig, config, sets), data, out)
    else:
        config, data, out = sys.argv[1:4]
        cfg = load_config(TrainConfig, config, ["batch_size=2", "dist_timeout=5", "steps=20"])
        fit(cfg, data, out, step_hook=hang)
