"""serve/core/scheduler.py and serve/core/step.py under what an ordinary client sends (issue 53):
chats with
no max_tokens share a pool by what they use, not each a whole context (item 4); the queue is
bounded when the pool, not the slots, is the limit (item 5); a default pool is bounded by the
memory available (item 6); an error between steps fails the requests it touched and the engine
thread serves the next one (item 11); a failed prompt chunk ends its own sequence, not the rows
that decoded in the same step (item 3); and sequences that outgrow the pool are preempted and
recomputed, their ids those they get alone. Each of these failed on the code before the engine
thread (61dc752), as its commit says."""

from __future__ import annotations

import asyncio

import pytest
from long_bundle import long_bundle, prompts, run_all

from doel.serve.core import service
from doel.serve.core.engine import BundleError, Engine, read_bundle
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.scheduler import QueueFull, Scheduler
from doel.serve.core.service import Service
from doel.serve.endpoints.chat import route as chat
from doel.serve.endpoints.chat.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tokenizer_path, tiny_model_config):
    return read_bundle(long_bundle(tmp_path_factory, tokenizer_path, tiny_model_config))


def widest(scheduler: Scheduler) -> list[int]:
    """Records how many sequences each step of `scheduler` runs."""
    seen, step = [], scheduler._step
    scheduler._step = lambda stepping: seen.append(len(stepping)) or step(stepping)
    return seen


def test_chats_without_max_tokens_run_together_under_a_pool_of_one_context(tiny_bundle):
    svc = Service.load(str(tiny_bundle), threads=1, slots=4, kv_positions=0)
    ctx = svc.context_length
    svc.scheduler.kv_positions = ctx  # one whole context for four chats, as --kv-positions
    seen = widest(svc.scheduler)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "নদী"}], temperature=0)

    async def four():
        async def one():
            return [p async for p in chat.pieces(svc, req.model_copy())][-1]

        return await asyncio.gather(*(one() for _ in range(4)))

    got = asyncio.run(four())
    # Each reserved a whole context before, so they ran one at a time; now by what they use.
    assert max(seen) >= 2
    assert all(p.finish_reason in ("stop", "length") for p in got)


def test_a_chat_without_max_tokens_under_a_smaller_pool_is_answered(tiny_bundle):
    svc = Service.load(str(tiny_bundle), threads=1, slots=2, kv_positions=48)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "নদী"}], temperature=0)

    async def answer():
        return [p async for p in chat.pieces(svc, req)]

    last = asyncio.run(answer())[-1]  # was a 400 naming a max_tokens it never sent
    assert last.prompt_tokens + last.completion_tokens <= 48


def test_the_queue_is_bounded_when_the_pool_is_the_limit(bundle):
    engine = Engine(bundle, threads=1, slots=4)
    s = Scheduler(engine, max_queue=2, kv_positions=engine.context_length)
    asks = prompts(50, 600, seed=4)  # one prompt nearly fills the pool: the others wait
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def burst():
        async def one(p):
            try:
                return len([t async for t in s.generate(p, params)])
            except QueueFull:
                return "refused"

        return await asyncio.gather(*(one(p) for p in asks))

    got = asyncio.run(burst())
    # Before: 49 waited and none was refused (the 429 needed every slot busy).
    assert got.count("refused") >= 40 and got.count(4) >= 3


def test_an_error_between_steps_fails_its_requests_and_the_next_one_runs(bundle):
    engine = Engine(bundle, threads=1, slots=2)
    s = Scheduler(engine)
    assign, calls = s.prefixes.assign, []

    def broken(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug in admission")
        return assign(*args, **kw)

    s.prefixes.assign = broken
    (p,) = prompts(1, 40)

    async def main():
        with pytest.raises(RuntimeError, match="a bug in admission"):
            await asyncio.wait_for(run_all(s, [p], 5), 20)  # before: hung for ever
        return await asyncio.wait_for(run_all(s, [p], 5), 20)

    (ids,) = asyncio.run(main())
    assert len(ids) == 5


def test_a_failed_chunk_ends_its_sequence_and_not_the_rows_decoding_beside_it(bundle):
    engine = Engine(bundle, threads=1, slots=2)
    s = Scheduler(engine, step_tokens=40)  # the long prompt goes in over many steps
    first, second = prompts(1, 20, seed=6)[0], prompts(1, 600, seed=8)[0]
    (alone,) = asyncio.run(run_all(Scheduler(engine), [first], 40))
    forward = engine.forward

    def failing(ids, past_len, slot=0, every=False):
        if past_len >= 200 and list(ids) == second[past_len : past_len + len(ids)]:
            raise RuntimeError("a chunk failed")  # mid-prefill, while the first decodes
        return forward(ids, past_len, slot=slot, every=every)

    engine.forward = failing

    async def one(p, new):
        try:
            params = SamplingParams(max_tokens=new, temperature=0.0)
            return [t async for t in s.generate(p, params)]
        except RuntimeError as e:
            return str(e)

    async def both():
        return await asyncio.gather(one(first, 40), one(second, 5))

    got_first, got_second = asyncio.run(both())
    engine.forward = forward
    assert "a chunk failed" in got_second
    assert got_first == alone  # before: ended with the failed chunk's error


def test_sequences_that_outgrow_the_pool_are_preempted_and_get_what_they_get_alone(bundle):
    engine = Engine(bundle, threads=1, slots=4)
    asks = prompts(4, 100, seed=7)
    alone = [asyncio.run(run_all(Scheduler(engine), [p], 120))[0] for p in asks]
    s = Scheduler(engine, kv_positions=600)  # four prompts fit; four replies of 120 do not
    seen = widest(s)
    assert asyncio.run(run_all(s, asks, 120)) == alone
    assert max(seen) == 4 and s.preemptions >= 1


def test_a_default_pool_is_bounded_by_the_memory_available(bundle, monkeypatch):
    engine = Engine(bundle, threads=1, slots=8)
    per = sum(a.nbytes for a in engine.kv_arrays) // (8 * engine.context_length)
    monkeypatch.setattr(service, "available_memory", lambda: 6 * engine.context_length * per)
    # Half of the memory, shared by three models: one context each (and never less).
    assert service.pool_positions(engine, 0, models=3) == engine.context_length
    assert service.pool_positions(engine, 0, models=1) == 3 * engine.context_length
    with pytest.raises(BundleError, match="--kv-positions 8192 needs"):
        service.pool_positions(engine, 8 * engine.context_length, models=1)
