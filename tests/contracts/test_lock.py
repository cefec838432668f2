"""One writer a folder at a time (doel/contracts/lock.py): prepare, fit, sft and the export's
staging refuse a folder another process holds, in one line naming its PID; a holder killed with
-9 leaves nothing to clean; two real `fit` processes on one --out (the reproduction); and the
export's staging folders that killed exports left beside --out are removed by the next export,
never those of a live one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doel.contracts.lock import FolderLock, lock_path
from doel.export.common import ExportError, staging
from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.data.chat import SFTConfig
from doel.train.data.prepare import prepare
from doel.train.fit import fit
from doel.train.sft import sft

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from doel.contracts.lock import FolderLock\n"
    "FolderLock(sys.argv[1], 'doel-train fit').acquire()\n"
    "for p in sys.argv[2:]:\n"
    "    Path(p).mkdir()\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def holder(folder: Path, *make: Path) -> subprocess.Popen:
    """Another process that holds `folder` (and made the folders `make`) until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), *map(str, make)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill_9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def test_a_folder_held_by_another_process_is_refused_by_every_writer_naming_its_pid(
    tmp_path, shards, tokenizer_path, sample_paths, tiny_config
):
    out = tmp_path / "out"
    proc = holder(out)
    try:
        named = rf"{out} is in use by process {proc.pid} \(doel-train fit\)"
        with pytest.raises(DoelError, match=named):
            prepare(tokenizer_path, sample_paths, out, progress=False, log=lambda s: None)
        with pytest.raises(DoelError, match=named):
            fit(tiny_config(), shards, out, log=lambda s: None)
        sft_cfg = load_config(SFTConfig, ROOT / "configs" / "tiny.toml", [])
        with pytest.raises(DoelError, match=named):
            sft(sft_cfg, [str(ROOT / "train" / "sample" / "chat.jsonl")], tmp_path, out)
        with pytest.raises(ExportError, match=named):
            with staging(out, force=True):
                pass
        assert not out.exists()  # none of them wrote anything
    finally:
        kill_9(proc)
    # kill -9 released it: the next writer takes it, and leaves no lock file behind
    with FolderLock(out, "test", DoelError):
        assert lock_path(out).read_text().startswith(f"{os.getpid()} test")
    assert not lock_path(out).exists()


def test_one_process_cannot_hold_a_folder_twice_and_release_frees_it(tmp_path):
    first = FolderLock(tmp_path / "run", "doel-train fit", DoelError).acquire()
    with pytest.raises(DoelError, match=f"in use by process {os.getpid()}"):
        FolderLock(tmp_path / "run" / ".." / "run", "doel-train fit", DoelError).acquire()
    first.release()
    FolderLock(tmp_path / "run", "again", DoelError).acquire().release()


def test_the_next_export_removes_staging_folders_of_killed_exports_not_of_live_ones(tmp_path):
    out = tmp_path / "bundle"
    killed = tmp_path / ".bundle.0123456789ab.tmp"  # what a killed export leaves
    killed.mkdir()
    (killed / "model.onnx.data").write_bytes(b"\0" * 1000)
    other = tmp_path / ".bundle.v2.0123456789ab.tmp"  # another --out's (bundle.v2): not ours
    other.mkdir()
    live = tmp_path / ".bundle.aaaaaaaaaaaa.tmp"
    proc = holder(out, live)  # an export running now, with its staging folder
    try:
        with pytest.raises(ExportError, match=f"in use by process {proc.pid}"):
            with staging(out, force=False):
                pass
        assert live.is_dir() and killed.is_dir()
    finally:
        kill_9(proc)
    with staging(out, force=False) as stage:
        (stage / "manifest.json").write_text('{"format": "doel-export"}')
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert hidden == [other.name]  # both dead exports' folders went, the lock file too
    assert (out / "manifest.json").is_file()


def _fit_cmd(shards, out) -> list[str]:
    args = [sys.executable, "-m", "doel.train", "fit", "--config", "tiny", "--data", str(shards)]
    args += ["--out", str(out), "--steps", "2000", "--skip-verify"]
    return args


@pytest.mark.slow  # spawns two training processes
def test_two_fits_on_one_out_the_second_stops_in_one_line_naming_the_first(tmp_path, shards):
    out = tmp_path / "run"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        _fit_cmd(shards, out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").is_file() and time.time() < deadline:
            assert first.poll() is None, first.stderr.read().decode()
            time.sleep(0.05)
        second = subprocess.run(
            _fit_cmd(shards, out), cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert first.poll() is None, "the first run ended before the second started"
    finally:
        kill_9(first)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [
        f"error: {out} is in use by process {first.pid} (doel-train fit); two writers would "
        "corrupt each other's files: wait for it to end, or choose another --out"
    ]
