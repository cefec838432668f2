"""An optimum bundle (a cache grown by concatenation, positions an input of the graph: a manifest
without kv_cache.past_present_share_buffer, served in one slot) goes through what every bundle
goes through in doel-serve: Service.load's warm-up, then the Scheduler, whose decoding rows go to
`Engine.decode` (issue 53, item 2: every second token failed there, so only `max_tokens: 1`
worked). Greedy ids through the Scheduler and through the app equal `Engine.generate`'s, and the
engine's release and warm-up leave nothing that changes a request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.scheduler import Scheduler
from doel.serve.edge.app import Settings, create_app

pytestmark = pytest.mark.slow

PROMPTS = [[0, 398, 841, 405, 679, 485, 420], [0, 17, 1203, 88, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def optimum_bundle(tiny_bundle, tmp_path_factory) -> Path:
    """The tiny bundle's checkpoint exported again by optimum."""
    pytest.importorskip("optimum")
    from doel.export.bundle import ExportOptions, export_checkpoint

    out = tmp_path_factory.mktemp("optimum") / "bundle"
    opts = ExportOptions(quant="fp32", engine="optimum", eval_tokens=32, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", out, opts)
    return out


@pytest.fixture(scope="module")
def alone(optimum_bundle) -> list[list[int]]:
    """Each prompt's greedy ids from `Engine.generate`, a fresh engine each."""
    got = []
    for p in PROMPTS:
        engine = Engine(read_bundle(optimum_bundle), threads=1)
        got.append(list(engine.generate(p, GREEDY)))
    assert all(len(ids) >= 8 for ids in got), got  # past the second token
    return got


async def scheduled(scheduler: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    async def one(p):
        return [t async for t in scheduler.generate(p, GREEDY)]

    return await asyncio.gather(*(one(p) for p in prompts))


def test_the_scheduler_decodes_an_optimum_bundle_as_engine_generate_does(optimum_bundle, alone):
    engine = Engine(read_bundle(optimum_bundle), threads=1)
    assert not engine.bundle.share_buffer and engine.bundle.position_ids
    engine.warm_up()
    # Two requests at once: one slot, so the second waits its turn and starts from nothing.
    assert asyncio.run(scheduled(Scheduler(engine), PROMPTS)) == alone


def test_the_app_serves_an_optimum_bundle_past_its_first_token(optimum_bundle, alone):
    with TestClient(create_app(Settings(bundle=str(optimum_bundle), threads=1))) as c:
        ready(c)
        body = {"prompt": PROMPTS[0], "max_tokens": GREEDY.max_tokens, "temperature": 0}
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == len(alone[0])


def test_decode_steps_the_growing_cache_as_forward_does(optimum_bundle):
    engine = Engine(read_bundle(optimum_bundle), threads=1)
    p = PROMPTS[0]
    first = int(engine.forward(p, 0).argmax())
    stepped = engine.decode([first], [len(p) + 1])
    assert stepped.shape == (1, engine.bundle.vocab_size)
    np.testing.assert_allclose(stepped[0], engine.forward(p + [first], 0), atol=1e-4)
    with pytest.raises(ValueError):
        engine.decode([first, first], [len(p) + 2] * 2)  # one slot
    with pytest.raises(ValueError):
        engine.forward([first], len(p), slot=1)
    with pytest.raises(ValueError):
        engine.copy_slot(0, 0, 1)


def test_release_keeps_what_it_is_asked_to_and_a_continuation_refuses_a_gap(optimum_bundle):
    engine = Engine(read_bundle(optimum_bundle), threads=1)
    p = PROMPTS[0]
    engine.forward(p, 0)
    engine.release(0, keep=4)  # the first 4 positions stay
    np.testing.assert_allclose(engine.forward(p[4:], 4), engine.forward(p, 0), atol=1e-4)
    engine.release(0)
    with pytest.raises(ValueError, match="holds 0"):
        engine.forward(p[4:], 4)  # nothing held to continue after


def test_the_warm_up_changes_no_request(optimum_bundle, alone):
    engine = Engine(read_bundle(optimum_bundle), threads=1)
    engine.warm_up()
    assert [list(engine.generate(p, GREEDY)) for p in PROMPTS] == alone
