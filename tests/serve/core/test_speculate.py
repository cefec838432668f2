"""serve/core/lookup.py and step.py's `_speculate` (issue 57, item 3): a draft is the continuation
of the last ids' most recent earlier occurrence; a lone sequence verifies it in one run and keeps
what the model itself picks, so on an fp32 bundle its ids, greedy or sampled with a seed, and its
log-probabilities are those of no drafting; max_tokens, the context's end, stop ids and the pool
bound it; and /metrics counts the draft ids verified and kept."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from doel.serve.core import lookup
from doel.serve.core.engine import Engine, read_bundle
from doel.serve.core.logprobs import Record
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.scheduler import Scheduler

REPEATING = [11, 12, 13, 14, 15, 16, 17] * 6  # every suffix occurs earlier: a draft each step


def ctx(ids: list[int], size: int = 64) -> np.ndarray:
    c = np.zeros(size, np.int64)
    c[: len(ids)] = ids
    return c


def test_a_draft_continues_the_longest_suffix_at_its_most_recent_occurrence():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last seen at 6-7 (followed by 7 8 5), not at 1-2 (followed by 9 9)
    assert lookup.draft(ctx(ids), len(ids), 3) == [7, 8, 5]
    ids = [4, 5, 6, 1, 2, 4, 5, 6, 3, 9, 2, 5, 6]
    # "2 5 6" was never seen; "5 6" was, at 1-2 and most recently at 6-7
    assert lookup.draft(ctx(ids), len(ids), 2) == [3, 9]
    ids = [7, 1, 2, 3, 8, 0, 1, 2, 3]
    assert lookup.draft(ctx(ids), len(ids), 4) == [8, 0, 1, 2]  # the longest: "1 2 3"


def test_no_draft_without_an_earlier_ngram_and_none_past_the_ids_made():
    ids = [1, 2, 3, 4, 5, 3]
    assert lookup.draft(ctx(ids), len(ids), 4) == []  # "5 3" unseen; one id alone is no match
    ids = [1, 2, 1, 2]
    assert lookup.draft(ctx(ids + [99]), len(ids), 8) == [1, 2]  # stops at n, not at the buffer
    assert lookup.draft(ctx(ids), len(ids), 0) == []
    assert lookup.draft(ctx([5]), 1, 4) == []


@pytest.fixture(scope="module")
def engine(tiny_bundle):
    e = Engine(read_bundle(tiny_bundle), threads=1, slots=2)
    e.warm_up()
    return e


def ids_of(s: Scheduler, prompt: list[int], params: SamplingParams, record=None) -> list[int]:
    async def run():
        return [t async for t in s.generate(prompt, params, record=record, cache=None)]

    return asyncio.run(run())


def both(engine, prompt, params, **kw) -> tuple[list[int], list[int], Scheduler]:
    plain = ids_of(Scheduler(engine, draft_tokens=0, **kw), prompt, params)
    s = Scheduler(engine, draft_tokens=4, **kw)
    return plain, ids_of(s, prompt, params), s


def test_greedy_ids_are_those_of_no_drafting_and_drafts_are_kept(engine):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain, drafted, s = both(engine, REPEATING, params)
    assert drafted == plain and len(plain) == 48
    assert s.drafted > 0 and 0 < s.accepted <= s.drafted


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_ids_with_a_seed_are_those_of_no_drafting(engine, seed):
    # Far from greedy (most ids differ from the greedy reply), near enough to repeat itself.
    params = SamplingParams(max_tokens=40, temperature=0.5, top_k=3, top_p=0.95, seed=seed)
    plain, drafted, s = both(engine, REPEATING, params)
    assert drafted == plain and s.accepted > 0


def test_log_probabilities_are_those_of_no_drafting(engine):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    got = []
    for k in (0, 4):
        record = Record(top=3, prompt=False)
        ids = ids_of(Scheduler(engine, draft_tokens=k), REPEATING, params, record)
        got.append((ids, record.entries))
    (a, ea), (b, eb) = got
    assert a == b and len(ea) == len(eb) == len(a)
    for x, y in zip(ea, eb):
        assert x.top_ids == y.top_ids
        np.testing.assert_allclose(x.logprob, y.logprob, atol=1e-4)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_is_met_exactly(engine, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain, drafted, _ = both(engine, REPEATING, params)
    assert drafted == plain and len(drafted) == max_tokens


def test_a_stop_id_in_the_middle_of_a_kept_draft_ends_there(engine):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = ids_of(Scheduler(engine, draft_tokens=0), REPEATING, params)
    stop = plain[len(plain) // 2]  # an id the greedy reply makes: it ends just before it
    params = SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=(stop,))
    drafted = ids_of(Scheduler(engine, draft_tokens=4), REPEATING, params)
    assert drafted == plain[: plain.index(stop)]


def test_the_context_end_and_a_tight_pool_bound_the_draft(engine):
    n = engine.context_length
    prompt = (REPEATING * (n // len(REPEATING) + 1))[: n - 6]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    plain, drafted, _ = both(engine, prompt, params)
    assert drafted == plain and len(drafted) == 6  # up to the context's last position
    # A pool of exactly the prompt and its reply: no draft may write past it.
    params = SamplingParams(max_tokens=20, temperature=0.0)
    plain, drafted, s = both(engine, REPEATING, params, kv_positions=len(REPEATING) + 20)
    assert drafted == plain and s.drafted > 0


def test_two_sequences_that_decode_together_never_draft(engine):
    s = Scheduler(engine, draft_tokens=4)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = (REPEATING, REPEATING[1:] + [11])  # equal lengths: both go in at one step

    async def two():
        async def one(p):
            return [t async for t in s.generate(p, params, cache=None)]

        with s._cond:  # the engine thread waits for both: they are admitted at one step
            tasks = [asyncio.ensure_future(one(p)) for p in prompts]
            while len(s._inbox) < len(prompts):
                await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    got = asyncio.run(two())
    # ONNX Runtime's attention verifies several ids after a cache for one row a run: two rows
    # stay one batched step, and decode as they do alone without drafts.
    assert s.drafted == 0
    for p, ids in zip(prompts, got):
        assert ids == ids_of(Scheduler(engine, draft_tokens=0), p, params)
