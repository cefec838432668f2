"""The KV cache as one pool that follows the work (serve/core/engine.py's `kv_buffer` and `release`,
serve/core/scheduler.py's admission and `_settle`): memory is taken as sequences grow and given back
as they end, measured from /proc with doel.contracts.memory (Pss: resident memory alone cannot
tell pages given back from pages a shared mapping still holds in shmem); what is given back
reads as zeros and leaves the machine's Shmem where it was; the serving process has no shared
anonymous mapping at all; more sequences than the pool holds wait; one longer than an even
share fits; a step's prompt chunk shrinks beside decoding rows; and greedy ids equal those of an
engine whose cache is the plain preallocated array it was before. On the session's long bundle
(1,024 positions), so a slot's cache spans many pages."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from live_server import live_server
from long_bundle import long_bundle, prompts, run_all

import doel.serve.core.engine as engine_module
from doel.contracts import memory
from doel.serve.core.engine import Engine, give_back, kv_buffer, read_bundle
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.scheduler import Scheduler
from doel.serve.core.service import Service
from doel.serve.core.step import MIN_CHUNK
from doel.serve.edge.refusal import RequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tokenizer_path, tiny_model_config):
    return read_bundle(long_bundle(tmp_path_factory, tokenizer_path, tiny_model_config))


def resident(engine: Engine) -> int:
    """Bytes of the engine's cache mappings the system pays for (their Pss), which are all
    private: a shared mapping's given-back pages would stay in shmem, unseen here."""
    got = memory.mappings(a.ctypes.data for a in engine.kv_arrays)
    assert got.complete, got.shmem_mappings
    return got.pss_bytes


def shmem_bytes() -> int:
    """The machine's shared memory (/proc/meminfo Shmem): where a shared mapping's pages stay."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def position_bytes(engine: Engine) -> int:
    """Bytes one position of one slot takes over every layer's keys and values."""
    return sum(a[0].nbytes for a in engine.kv_arrays) // engine.context_length


def test_memory_is_taken_as_sequences_grow_and_given_back_after_a_burst(bundle):
    engine = Engine(bundle, threads=1, slots=8)
    engine.warm_up()
    reserved = sum(a.nbytes for a in engine.kv_arrays)
    idle = resident(engine)
    assert idle < 0.1 * reserved  # warm-up wrote a chunk in slot 0 and one entry per slot

    async def burst():
        s = Scheduler(engine, prefix_keep=0.3)
        await run_all(s, prompts(8, 300), 100)
        held = resident(engine)  # each slot keeps its sequence for a next turn
        await asyncio.sleep(0.6)  # past prefix_keep: the loop gives it all back
        return held, resident(engine), s.held_positions()

    held, after, positions = asyncio.run(burst())
    assert held >= 0.9 * 8 * 399 * position_bytes(engine)
    assert after <= idle + 8 * 4096 * 2 * len(engine.kv_arrays)  # a page or two per slot
    assert positions == 0


def test_a_released_slots_positions_read_back_as_zeros(bundle):
    """Pages given back are the system's again: they read as zeros (a shared mapping's read
    back their old entries, still held in shmem)."""
    engine = Engine(bundle, threads=1, slots=2)
    engine.forward(prompts(1, 600, seed=5)[0], 0, slot=1)
    before = [a[1].copy() for a in engine.kv_arrays]
    assert all(np.any(b[:, :600]) for b in before)
    engine.release(1, keep=300)  # whole pages past position 300: from 320 on here
    page = engine_module.PAGE // (engine.kv_arrays[0][1, 0, 0].nbytes)  # positions a page
    past = -(-300 // page) * page
    for a, b, last in zip(engine.kv_arrays, before, engine._positions_last):
        if not last:
            assert np.array_equal(a[1][:, :300], b[:, :300])  # what it keeps stays
            assert not np.any(a[1][:, past:])
    engine.release(1, keep=0)
    assert not any(np.any(a[1]) for a in engine.kv_arrays)


def test_a_buffer_given_back_leaves_the_machines_shmem_and_the_processs_pss():
    """64 MiB written, then given back: Pss falls by it, and Shmem (system-wide) does not
    keep it (a MAP_SHARED buffer's Shmem stays up by the whole buffer)."""
    size = 64 * 2**20
    stages = [(shmem_bytes(), memory.measure())]
    array, buf = kv_buffer((size // 4,), np.float32)
    array[:: engine_module.PAGE // 4] = 1.0  # every page written
    stages.append((shmem_bytes(), memory.measure()))
    give_back(buf, 0, size)
    stages.append((shmem_bytes(), memory.measure()))
    for what, of in (("Shmem", lambda s: s[0]), ("Pss", lambda s: s[1].pss_bytes),
                     ("RSS", lambda s: s[1].rss_bytes)):  # fmt: skip
        print(what, " -> ".join(f"{of(s) / 2**20:.0f}" for s in stages), "MiB")
    (shmem0, m0), (shmem1, m1), (shmem2, m2) = stages
    assert m1.pss_bytes - m0.pss_bytes >= 0.95 * size
    assert m1.pss_bytes - m2.pss_bytes >= 0.95 * size
    assert shmem2 - shmem0 < size / 2
    assert not np.any(array)
    assert memory.mappings([array.ctypes.data]).complete


def test_the_serving_process_has_no_shared_anonymous_mapping(bundle, tmp_path):
    with live_server(bundle.folder, tmp_path, "--slots", "4") as server:
        got = memory.measure(server.proc.pid)
    assert got.pss_bytes > 0
    assert got.shmem_mappings == ()


def test_more_sequences_than_the_pool_holds_wait_and_get_what_they_get_alone(bundle):
    engine = Engine(bundle, threads=1, slots=4)
    asks = prompts(4, 200, seed=1)
    alone = [asyncio.run(run_all(Scheduler(engine), [p], 40))[0] for p in asks]
    s = Scheduler(engine, kv_positions=2 * 240)  # two requests' prompts + max_tokens
    widest, step = [], s._step
    s._step = lambda stepping: widest.append(len(stepping)) or step(stepping)
    assert asyncio.run(run_all(s, asks, 40)) == alone
    assert max(widest) == 2


def test_a_sequence_longer_than_an_even_share_of_the_pool_fits(bundle):
    engine = Engine(bundle, threads=1, slots=4)
    s = Scheduler(engine, kv_positions=engine.context_length)  # an even share: 256 each
    (long,) = asyncio.run(run_all(s, prompts(1, 600, seed=2), 300))
    assert len(long) == 300


def test_a_request_past_a_smaller_pool_is_a_400_naming_the_flag(bundle):
    engine = Engine(bundle, threads=1, slots=2)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundle.tokenizer))
    svc = Service(engine, tok, "m", kv_positions=512)
    svc.check_fits(400, 112)  # exactly the pool
    with pytest.raises(RequestError) as e:
        svc.check_fits(400, 200)
    assert e.value.status == 400 and "--kv-positions" in str(e.value)
    assert e.value.param == "max_tokens"


def steps_of(engine: Engine, scheduler: Scheduler, asks: list[list[int]]) -> list[tuple]:
    """(decoding ids, prompt chunk lengths) of each step that runs `asks` together: a row's,
    or a verified draft's."""
    steps, now = [], {"rows": 0, "chunks": []}
    forward, decode, step = engine.forward, engine.decode, scheduler._step
    engine.decode = lambda t, n, lo=0: now.__setitem__("rows", len(t)) or decode(t, n, lo)

    def watched(ids, past_len, slot=0, every=False):
        if every:  # a lone row's draft verified (step.py's _speculate): decoding ids
            now["rows"] = len(ids)
        else:
            now["chunks"].append(len(ids))
        return forward(ids, past_len, slot=slot, every=every)

    def stepped(stepping):
        now["rows"], now["chunks"] = 0, []
        out = step(stepping)
        steps.append((now["rows"], now["chunks"]))
        return out

    engine.forward, scheduler._step = watched, stepped
    try:
        asyncio.run(run_all(scheduler, asks, 60))
    finally:
        engine.forward, engine.decode = forward, decode
    return steps


@pytest.mark.parametrize("budget", [40, 300])
def test_a_step_keeps_to_its_token_budget(bundle, budget):
    engine = Engine(bundle, threads=1, slots=4)
    steps = steps_of(engine, Scheduler(engine, step_tokens=budget), prompts(3, 300, seed=3))
    for rows, chunks in steps:
        if rows:  # beside decoding rows: what they left, at least MIN_CHUNK
            assert sum(chunks) <= max(MIN_CHUNK, budget - rows)
        elif chunks:  # the first prompt gets a whole chunk, others share what is left
            assert chunks[0] <= engine.prefill_chunk
            assert sum(chunks[1:]) <= max(0, budget - chunks[0])
    assert any(rows and chunks for rows, chunks in steps)
    shared = [chunks for rows, chunks in steps if not rows and len(chunks) > 1]
    assert bool(shared) == (budget - engine.prefill_chunk >= MIN_CHUNK)


def test_greedy_ids_equal_an_engine_with_the_plain_preallocated_cache(bundle, monkeypatch):
    asks = [p[:n] for p, n in zip(prompts(4, 500, seed=4), (500, 37, 260, 129))]
    engine = Engine(bundle, threads=1, slots=4)
    got = asyncio.run(run_all(Scheduler(engine, step_tokens=20), asks, 50))
    monkeypatch.setattr(
        engine_module, "kv_buffer", lambda shape, dtype: (np.zeros(shape, dtype), None)
    )
    plain = Engine(bundle, threads=1, slots=1)
    params = SamplingParams(max_tokens=50, temperature=0)
    assert got == [list(plain.generate(p, params)) for p in asks]
