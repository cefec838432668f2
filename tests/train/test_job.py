"""The skeleton fit and sft share (doel.train.job): sft's loader resumes through the path fit's
does, and both runs' checks before step 1 are cached by one key."""

from __future__ import annotations

import json

import numpy as np
import torch
from micro import MODEL, train_config

from doel.train.build import build_parts
from doel.train.checkpoint import latest_checkpoint, save_checkpoint
from doel.train.data.chat import ChatData, ChatLoader
from doel.train.dist import DistInfo
from doel.train.job import VERIFIED, Checks, Job, verify_key

cfg = train_config


def chat_parts(resume_from=None, log=lambda s: None):
    """What sft builds: build_parts with a ChatLoader (5 conversations, 2 a batch) and no shards."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(7, MODEL.vocab_size, size=n) for n in (9, 12, 17, 5, 20)]
    data = ChatData(ids=ids, masks=[np.arange(len(a)) % 2 == 1 for a in ids])
    c = cfg(batch_size=2, dtype="float32")
    return build_parts(
        c,
        None,
        loader_factory=lambda: ChatLoader(data, 2, c.seq_len, c.seed, {"pad": 0}),
        device=torch.device("cpu"),
        compile=False,
        resume_from=resume_from,
        log=log,
    )


def test_sft_s_chat_loader_resumes_through_build_parts_as_fit_s_shards_do(tmp_path):
    parts = chat_parts()
    for _ in range(3):  # into the second epoch: 2 batches of 2 use 4 of the 5 conversations
        parts.loader.next_batch()
    state = {"loader": parts.loader.state_dict(), "tokens_seen": 99}
    save_checkpoint(tmp_path, 3, parts.wrapped, parts.optimizer, state)
    expected = [parts.loader.next_batch() for _ in range(3)]
    lines = []
    resumed = chat_parts(latest_checkpoint(tmp_path), lines.append)
    assert (resumed.step, resumed.tokens_seen) == (3, 99)
    assert any(line.startswith("resuming from") and "(step 3)" in line for line in lines)
    got = [resumed.loader.next_batch() for _ in range(3)]
    assert all(np.array_equal(a, b) for e, g in zip(expected, got) for a, b in zip(e, g))
    assert not np.array_equal(
        chat_parts().loader.next_batch()[0], expected[0][0]
    )  # not a fresh one


def test_the_checks_before_step_1_are_cached_by_one_key_of_each_run_s_inputs(tmp_path):
    parts, calls = chat_parts(), []

    def checks(data_hash):  # sft's inputs; fit's are the shards' meta.json hash
        def run_them(out):
            calls.append(out)
            out.mkdir(parents=True, exist_ok=True)

        inputs = {"data_sha256": data_hash}
        return Checks(
            perform=run_them, inputs=lambda: inputs, skipped="the chat checks did not run"
        )

    def verify(data_hash, resumed=True, skip_verify=False):
        lines = []
        ckpt = tmp_path / "checkpoints" / "step-000002" if resumed else None
        cpu = torch.device("cpu")
        # resume_from: what prepare() finds; only whether there is one matters to verify()
        job = Job(
            out=tmp_path,
            info=DistInfo(),
            device=cpu,
            log=lines.append,
            resume_from=ckpt,
            skip_verify=skip_verify,
        )
        job.verify(parts, checks(data_hash))
        return lines

    verify("a", resumed=False)
    assert calls == [tmp_path / "verify"]
    key = json.loads((tmp_path / VERIFIED).read_text())
    assert key == verify_key(parts.cfg, DistInfo(), {"data_sha256": "a"})
    assert list(key) == ["config", "data_sha256", "world_size", "torch"]
    lines = verify("a")  # an unchanged resume: the gate alone
    assert len(calls) == 1 and any("not repeated on resume" in line for line in lines)
    assert any("every one has a finite, nonzero gradient" in line for line in lines)
    verify("b")  # other data: checked again
    assert len(calls) == 2
    lines = verify("c", skip_verify=True)
    assert len(calls) == 2 and lines[0] == (
        "WARNING: --skip-verify: the chat checks did not run; only the gradient-flow gate runs"
    )
