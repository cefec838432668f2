"""Files damaged after they were written are named, never used silently (issue 36, 6-8): shards
whose bytes differ from meta.json's sha256, checkpoints whose model, optimizer or RNG file differs
from their checksums.json (at resume and at export), an id outside the vocabulary in a shard, a
disk that fills during a checkpoint; each in one line, with --no-checksums (doel-train,
doel-export and doel-serve alike) for whoever needs it. And an unchanged resume skips the checks
before step 1 even after prepare wrote meta.json again (issue 38, 7)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from doel.contracts import checksums
from doel.train.checkpoint import latest_checkpoint, save_checkpoint
from doel.train.cli import main as train_main
from doel.train.common import Damaged, DoelError
from doel.train.data.loader import TokenLoader
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.shards import HEADER_BYTES
from doel.train.fit import fit
from doel.train.model import Llama
from doel.train.optim import build_optimizer


class Killed(Exception):
    pass


def flip(path: Path, n: int = 32, step: int = 1) -> bytes:
    """XOR n payload bytes near the end of the file with 0xFF (every `step`-th); returns the old
    bytes. A shard's low bytes only (step 2): its ids stay inside the vocabulary."""
    data = bytearray(path.read_bytes())
    old = bytes(data)
    for i in range(len(data) - 2 * n * step, len(data), step)[:n]:
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return old


def shards_copy(shards: Path, tmp_path: Path) -> Path:
    data = tmp_path / "shards"
    shutil.copytree(shards, data)
    return data


def train_shard(data: Path) -> Path:
    meta = json.loads((data / "meta.json").read_text())
    return data / meta["splits"]["train"]["shards"][0]["file"]


def test_a_shard_whose_bytes_differ_from_meta_json_is_refused_naming_it(shards, tmp_path):
    data = shards_copy(shards, tmp_path)
    TokenLoader(data, batch_size=2, seq_len=64)  # whole: opens
    shard = train_shard(data)
    flip(shard, step=2)
    with pytest.raises(Damaged, match=f"{shard} does not match the sha256 meta.json records"):
        TokenLoader(data, batch_size=2, seq_len=64)
    loader = TokenLoader(data, batch_size=2, seq_len=64, verify=False)  # --no-checksums
    assert loader.next_batch()[0].shape == (2, 64)


def test_an_id_outside_the_vocabulary_names_the_shard_and_its_offset(shards, tmp_path):
    data = shards_copy(shards, tmp_path)
    shard = train_shard(data)
    ids = np.memmap(shard, dtype=np.uint16, mode="r+", offset=HEADER_BYTES)
    ids[777] = 2048  # the vocabulary is 0..2047
    ids.flush()
    del ids
    meta = json.loads((data / "meta.json").read_text())  # as a prepare with another tokenizer
    meta["splits"]["train"]["shards"][0]["sha256"] = checksums.sha256_file(shard)
    (data / "meta.json").write_text(json.dumps(meta))
    loader = TokenLoader(data, batch_size=4, seq_len=64)
    with pytest.raises(DoelError) as e:
        for _ in range(5 * loader.n_windows // 4):  # epochs: one reaches the window holding it
            loader.next_batch()
    assert str(e.value).startswith(
        f"{shard}: token 777 (byte {HEADER_BYTES + 2 * 777:,}) is id 2048"
    )
    assert "\n" not in str(e.value)


def _tiny_checkpoint(tmp_path, tokenizer_path, tiny_config) -> Path:
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Llama(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).backward()
    opt.step()
    return save_checkpoint(tmp_path / "run", 1, model, opt, {"loader": {}}, tokenizer_path)


def test_export_refuses_a_checkpoint_whose_weights_differ_from_checksums_json(
    tmp_path, tokenizer_path, tiny_config
):
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.common import ExportError

    step = _tiny_checkpoint(tmp_path, tokenizer_path, tiny_config)
    assert inspect_checkpoint(step).hashes["model.safetensors"]  # whole: checked, hashed once
    weights = step / "model.safetensors"
    flip(weights)
    with pytest.raises(ExportError, match=f"{weights} does not match the sha256 checksums.json"):
        inspect_checkpoint(step)
    assert inspect_checkpoint(step, verify=False).hashes == {}  # --no-checksums
    flip(step / "optimizer.safetensors")  # not the model's: the export neither reads nor checks it
    assert inspect_checkpoint(step, verify=False).weights == (weights,)


def test_doel_export_prints_the_damaged_file_in_one_line(tmp_path, tokenizer_path, tiny_config):
    pytest.importorskip("onnxruntime")
    from doel.export.cli import main as export_main

    step = _tiny_checkpoint(tmp_path, tokenizer_path, tiny_config)
    flip(step / "model.safetensors")
    with pytest.raises(SystemExit) as e:
        export_main([str(step), "--out", str(tmp_path / "bundle")])
    assert str(e.value.code).startswith(f"error: {step / 'model.safetensors'} does not match")
    assert "--no-checksums" in str(e.value.code) and not (tmp_path / "bundle").exists()


@pytest.mark.slow  # trains
def test_fit_refuses_damaged_shards_in_one_line_and_trains_with_no_checksums(
    shards, tmp_path, capsys
):
    data = shards_copy(shards, tmp_path)
    shard = train_shard(data)
    flip(shard, step=2)
    args = ["fit", "--config", "tiny", "--data", str(data), "--out", str(tmp_path / "run")]
    args += ["--steps", "1", "--skip-verify"]
    with pytest.raises(SystemExit) as e:
        train_main(args)
    assert str(e.value.code).startswith(f"error: {shard} does not match the sha256")
    train_main([*args, "--no-checksums"])
    assert (tmp_path / "run" / "final" / checksums.NAME).is_file()


@pytest.mark.slow  # trains
def test_a_resume_refuses_a_checkpoint_whose_files_differ_from_their_hashes(
    shards, tmp_path, tiny_run_config
):
    run = tmp_path / "run"
    cfg = tiny_run_config("steps=3", "checkpoint_every=1")

    def killer(line):
        if line.startswith("step      3/"):
            raise Killed

    with pytest.raises(Killed):
        fit(cfg, shards, run, log=killer, skip_verify=True)
    step = latest_checkpoint(run)
    assert step.name == "step-000002"
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
        old = flip(step / name)
        with pytest.raises(Damaged, match=f"{step / name} does not match the sha256") as e:
            fit(cfg, shards, run, log=lambda s: None, skip_verify=True)
        assert "--no-checksums" in str(e.value) and "\n" not in str(e.value)
        (step / name).write_bytes(old)
    flip(step / "rng.safetensors")
    lines = []
    fit(cfg, shards, run, log=lines.append, skip_verify=True, no_checksums=True)
    assert any("resuming from" in line and "step 2" in line for line in lines)


@pytest.mark.slow  # trains
def test_fit_on_a_shard_with_an_id_outside_the_vocabulary_says_where(shards, tmp_path):
    data = shards_copy(shards, tmp_path)
    shard = train_shard(data)
    ids = np.memmap(shard, dtype=np.uint16, mode="r+", offset=HEADER_BYTES)
    ids[1::64] = 4000  # in every window
    ids.flush()
    del ids
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"]["train"]["shards"][0]["sha256"] = checksums.sha256_file(shard)
    (data / "meta.json").write_text(json.dumps(meta))
    args = ["fit", "--config", "tiny", "--data", str(data), "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        train_main([*args, "--steps", "1", "--skip-verify"])
    assert str(e.value.code).startswith(f"error: {shard}: token ")
    assert "is id 4000, outside the vocabulary of 2048" in str(e.value.code)


@pytest.mark.slow  # trains, on a tmpfs it mounts
def test_a_disk_full_during_a_checkpoint_is_one_line_and_the_last_one_stays(
    shards, tmp_path, tiny_run_config
):
    small = tmp_path / "small"
    small.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(small)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run, filler = small / "run", small / "filler"
        cfg = tiny_run_config("steps=3", "checkpoint_every=1")

        def fill(step):  # after step 2, before its checkpoint: half a checkpoint's room left
            if step == 2:
                first = run / "checkpoints" / "step-000001"
                size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
                free = shutil.disk_usage(small).free
                filler.write_bytes(b"\0" * (free - size // 2))

        with pytest.raises(DoelError) as e:
            fit(cfg, shards, run, log=lambda s: None, step_hook=fill, skip_verify=True)
        message = str(e.value)
        assert message.startswith(
            f"no space left on the device of {run / 'checkpoints'} for the checkpoint of step 2: "
            "it needs about "
        )
        assert f"a resume will use {run / 'checkpoints' / 'step-000001'}" in message
        assert "\n" not in message
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]
        filler.unlink()
        lines = []
        fit(cfg, shards, run, log=lines.append, skip_verify=True)  # the hashes check out
        assert any("resuming from" in line and "step 1" in line for line in lines)
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.slow  # trains, and runs the checks before step 1
def test_an_unchanged_resume_skips_the_checks_after_prepare_wrote_meta_json_again(
    tmp_path, tokenizer_path, sample_paths, tiny_run_config
):
    data, run = tmp_path / "shards", tmp_path / "run"
    cfg = PrepareConfig(val_fraction=0.1)
    prepare(tokenizer_path, sample_paths, data, cfg, progress=False, log=lambda s: None)
    train = tiny_run_config("steps=3", "checkpoint_every=1")

    def killer(line):
        if line.startswith("step      2/"):
            raise Killed

    with pytest.raises(Killed):
        fit(train, data, run, log=killer)
    before = json.loads((data / "meta.json").read_text())
    # The same shards again; only how long it took differs (seconds, tokens_per_second).
    prepare(
        tokenizer_path, sample_paths, data, cfg, progress=False, resume=False, log=lambda s: None
    )
    assert json.loads((data / "meta.json").read_text())["splits"] == before["splits"]
    lines = []
    fit(train, data, run, log=lines.append)
    assert any("not repeated on resume" in line for line in lines), lines
