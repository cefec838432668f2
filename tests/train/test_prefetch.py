"""The step loop's prefetch (issue 56, item 5): the next step's batches are read while the
current one computes, yet the run sees the same batches in the same order and a checkpoint keeps
the loader's position before the step read ahead (or a resumed run would skip it)."""

from __future__ import annotations

import torch

from doel.train.data.loader import TokenLoader
from doel.train.loop import batches_on
from doel.train.prefetch import Prefetcher


def _loader(shards):
    return TokenLoader(shards, "train", 2, 32, seed=3)


def test_the_prefetched_run_sees_the_same_batches_and_saves_the_right_position(shards):
    plain, ahead = _loader(shards), _loader(shards)
    pf = Prefetcher(ahead, torch.device("cpu"), 2)
    for _ in range(5):
        want, got = batches_on(plain, torch.device("cpu"), 2), pf.next()
        pf.prefetch()  # as the loop does once a step is queued
        assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    assert ahead.state_dict() != plain.state_dict()  # the loader itself is a step ahead
    assert pf.state_dict() == plain.state_dict()  # what a checkpoint keeps is not
    resumed = _loader(shards)
    resumed.load_state_dict(pf.state_dict())
    nxt = batches_on(resumed, torch.device("cpu"), 2)
    assert all(torch.equal(a, b) for w, g in zip(nxt, pf.next()) for a, b in zip(w, g))
