"""`doel-train sft` runs on a tiny base model: exact resume after a kill, the chat template and
model card in the result, a base whose vocabulary predates the turn markers, a planted loss
mask refused before step 1, the command line's one-line errors, and two ranks under torchrun
equal to one process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import doel.train.data.chat as chat
from doel.train.checkpoint import latest_checkpoint
from doel.train.checks.suite import VerificationError
from doel.train.cli import main
from doel.train.config import load_config
from doel.train.data.chat import SFTConfig
from doel.train.data.tokenizer import CHAT_TOKENS
from doel.train.hf import save_model
from doel.train.metrics import read_metrics
from doel.train.model import Llama
from doel.train.sft import sft

pytestmark = pytest.mark.slow  # each test fine-tunes (or starts to) a model
ROOT = Path(__file__).resolve().parents[2]
CHAT = str(ROOT / "train" / "sample" / "chat.jsonl")


def tiny_sft(*sets: str) -> SFTConfig:
    return load_config(
        SFTConfig,
        ROOT / "configs" / "tiny.toml",
        ["seq_len=128", "log_every=1", "batch_size=4", *sets],
    )


@pytest.fixture(scope="module")
def old_base(tmp_path_factory, tokenizer_path) -> Path:
    """A random tiny model whose tokenizer names ids 3-6 <|reserved_0..3|>, as before chat."""
    root = tmp_path_factory.mktemp("sft-base")
    data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    for i, name in enumerate(CHAT_TOKENS):
        next(a for a in data["added_tokens"] if a["id"] == 3 + i)["content"] = f"<|reserved_{i}|>"
        data["model"]["vocab"][f"<|reserved_{i}|>"] = data["model"]["vocab"].pop(name)
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    torch.manual_seed(0)
    base = save_model(Llama(tiny_sft().model), root / "base", tokenizer=root / "tok")
    assert "chat_template" not in json.loads((base / "tokenizer_config.json").read_text())
    return base


class Killed(Exception):
    pass


def test_sft_resumes_bit_identically_and_writes_a_chat_model(tmp_path, old_base):
    cfg = tiny_sft("steps=8", "checkpoint_every=4", "eval_every=4")
    lines = []
    whole = sft(cfg, [CHAT], old_base, tmp_path / "whole", log=lines.append)
    assert any("predates the chat markers" in line for line in lines)
    assert any(line.startswith("  pass loss_mask") for line in lines)
    assert any("validation at step 8" in line and "held-out" in line for line in lines)

    def killer(line):  # dies while logging step 6: the step-4 checkpoint is the last one
        if line.startswith("step      6/"):
            raise Killed

    with pytest.raises(Killed):
        sft(cfg, [CHAT], old_base, tmp_path / "resumed", log=killer)
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000004"
    again = []
    resumed = sft(cfg, [CHAT], old_base, tmp_path / "resumed", log=again.append)
    assert any("resuming from" in line and "step 4" in line for line in again)
    assert any("not repeated" in line or "passed before step 1" in line for line in again)
    a, b = (
        load_file(str(whole / "model.safetensors")),
        load_file(str(resumed / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def losses(run):
        rows = read_metrics(run / "metrics.jsonl")
        return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]

    assert losses(tmp_path / "whole") == losses(tmp_path / "resumed")
    assert [s for s, _ in losses(tmp_path / "resumed")] == list(range(1, 9))
    base_weights = load_file(str(old_base / "model.safetensors"))
    assert not torch.equal(a["model.norm.weight"], base_weights["model.norm.weight"])

    conf = json.loads((whole / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert conf["chat_template"].startswith("{{ bos_token }}")
    card = (whole / "README.md").read_text(encoding="utf-8")
    assert "## Chat fine-tuning" in card and f"Base model: `{old_base}`" in card
    assert f"Data: `{CHAT}`" in card and "| steps | 8 |" in card
    assert "| **pass** |" in (tmp_path / "whole" / "verify" / "verify.md").read_text()


def test_a_planted_mask_that_learns_user_tokens_is_refused_before_step_1(
    tmp_path, old_base, monkeypatch
):
    real = chat.render_many

    def planted(tok, conversations, ids=None):
        out = []
        for seq, mask in real(tok, conversations, ids):
            mask = mask.copy()
            mask[np.flatnonzero(seq == 4)[0] + 1] = True  # the first user token learnt
            out.append((seq, mask))
        return out

    monkeypatch.setattr(chat, "render_many", planted)
    lines = []
    with pytest.raises(VerificationError, match="loss_mask"):
        sft(tiny_sft("steps=2"), [CHAT], old_base, tmp_path / "run", log=lines.append)
    assert any(line.startswith("  FAIL loss_mask") and "outside" in line for line in lines)
    assert latest_checkpoint(tmp_path / "run") is None


def test_the_command_line_names_a_bad_conversation_and_a_bad_base(tmp_path, old_base, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    argv = ["sft", "--config", "tiny", "--set", "seq_len=128", "--data", str(bad)]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--from", str(old_base), "--out", str(tmp_path / "run")])
    assert str(e.value).startswith(f"error: {bad}:1: the last message is 'user'")
    with pytest.raises(SystemExit) as e:
        main([*argv, "--from", str(tmp_path), "--out", str(tmp_path / "run")])
    assert "no config.json" in str(e.value) and "doel-train fit" in str(e.value)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--from", str(old_base), "--out", "x", "--set", "overlong=cut"])
    assert "overlong must be one of" in str(e.value)


def test_sft_on_two_ranks_equals_one_process_taking_the_same_micro_batches(tmp_path, old_base):
    """torchrun, 2 gloo ranks of 2 conversations each, against one process accumulating the same
    two micro-batches (rank r's rows are micro-batch r: ChatLoader slices one global batch).
    The loss is normalised by the step's assistant tokens over both ranks, which differ per
    rank; halving is exact and gloo sums two numbers exactly, so the runs match bit for bit."""

    def cmd(out, nproc, *sets):
        args = ["sft", "--config", "tiny", "--data", CHAT, "--from", str(old_base)]
        args += ["--out", str(out), "--steps", "3", "--skip-verify"]
        for s in ("seq_len=128", "log_every=1", "eval_every=0", "checkpoint_every=0", *sets):
            args += ["--set", s]
        if nproc == 1:
            return [sys.executable, "-m", "doel.train", *args]
        dist = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*dist, f"--nproc_per_node={nproc}", "-m", "doel.train", *args]

    env = os.environ | {"OMP_NUM_THREADS": "1"}
    for out, nproc, sets in (
        (tmp_path / "one", 1, ("batch_size=2", "grad_accum=2")),
        (tmp_path / "two", 2, ("batch_size=2",)),
    ):
        p = subprocess.run(
            cmd(out, nproc, *sets), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "2 ranks" in p.stdout

    def losses(run):
        return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]

    assert len(losses(tmp_path / "one")) == 3
    assert losses(tmp_path / "two") == losses(tmp_path / "one")
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_a_base_trained_further_is_fine_tuned_again_and_named_by_hash(tmp_path, old_base):
    """Issue 38.6: sft of a base, then the base trained further (new weights in the same
    folder), then sft again: it trains from the new base, not "nothing to train" over the old
    base's chat model; the card names the base's weights by sha256. Unchanged: skipped."""
    cfg = tiny_sft("steps=2", "checkpoint_every=2", "eval_every=0")
    base = tmp_path / "run" / "final"

    def train_base(seed: int) -> str:
        torch.manual_seed(seed)
        save_model(Llama(cfg.model), base, tokenizer=old_base.parent / "tok")
        return hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()

    def fine_tune() -> tuple[list[str], dict, str]:
        lines = []
        final = sft(cfg, [CHAT], base, tmp_path / "chat", log=lines.append, skip_verify=True)
        weights = load_file(str(final / "model.safetensors"))
        return lines, weights, (final / "README.md").read_text(encoding="utf-8")

    first = train_base(0)
    _, old_chat, card = fine_tune()
    assert f"weights sha256 `{first}`" in card
    lines, same, _ = fine_tune()  # the same base: nothing to do, as before
    assert any(line.startswith("nothing to train") for line in lines), lines
    assert all(torch.equal(old_chat[k], same[k]) for k in old_chat)

    second = train_base(1)
    lines, new_chat, card = fine_tune()
    assert any("the base model changed" in line and first[:12] in line for line in lines), lines
    assert not any(line.startswith("nothing to train") for line in lines), lines
    assert f"weights sha256 `{second}`" in card and first not in card
    assert not torch.equal(old_chat["model.norm.weight"], new_chat["model.norm.weight"])
    recorded = json.loads((tmp_path / "chat" / "base.json").read_text(encoding="utf-8"))
    assert recorded == {"path": str(base), "sha256": second}
