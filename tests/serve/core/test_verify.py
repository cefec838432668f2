"""The bundle checked before it is served (issue 36, point 6): doel-serve hashes the files it
reads against the sha256 the manifest records, while the model loads; 32 flipped bytes of
model.onnx.data end it with a one-line error naming the file, a truncated file too, and
--no-checksums serves the bundle as it is. The check of the tiny bundle takes milliseconds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
from live_server import ROOT, free_port, live_server

from doel.serve.core.engine import read_bundle
from doel.serve.core.verify import Damaged, check, served_files


@pytest.fixture
def damaged(tiny_bundle, tmp_path):
    folder = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, folder)
    data = folder / "model.onnx.data"
    with open(data, "r+b") as f:  # 32 bytes in the middle, flipped
        f.seek(data.stat().st_size // 2)
        chunk = f.read(32)
        f.seek(-32, 1)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return folder


def test_the_files_serve_reads_are_checked_in_milliseconds(tiny_bundle):
    bundle = read_bundle(tiny_bundle)
    assert {"model.onnx", "model.onnx.data", "tokenizer.json"} <= set(served_files(bundle))
    seconds = check(bundle)
    print(f"verified {tiny_bundle} in {seconds * 1e3:.1f} ms")
    assert seconds < 2


def test_a_flipped_or_truncated_file_is_named(damaged):
    with pytest.raises(Damaged, match=r"model\.onnx\.data does not match the sha256") as e:
        check(read_bundle(damaged))
    assert "\n" not in str(e.value) and "--no-checksums" in str(e.value)
    tok = damaged / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-10])
    with pytest.raises(Damaged, match=r"tokenizer\.json is truncated or damaged"):
        check(read_bundle(damaged))


def test_doel_serve_refuses_a_damaged_bundle_in_one_line(damaged, tmp_path):
    cmd = [sys.executable, "-m", "doel.serve", str(damaged), "--port", str(free_port())]
    start = time.monotonic()
    done = subprocess.run(
        [*cmd, "--threads", "1", "--log-level", "warning"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1 and "model.onnx.data does not match" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - start < 60
    # --no-checksums serves it as it is.
    with live_server(damaged, tmp_path, "--no-checksums") as s:
        assert s.proc.poll() is None
