"""Continuous batching: concurrent requests share decode steps.

Each request gets a slot of the engine's cache. One loop runs steps while there is work: a step
advances every sequence whose prompt is in the cache by one token in a single batched run, so the
weights are read once per step for all of them and throughput grows with load; then it feeds one
chunk (the engine's prefill chunk, PREFILL_CHUNK tokens) of the oldest prompt not yet in. A
prompt of any length thus delays the running streams by one chunk's time per token, not by its
whole prefill (prefill times by prompt length: benchmarks/results/serve_0.4b_cpu-*.md). A finished
or abandoned sequence frees its slot at the next step, and a waiting request takes it: the free
slot whose cache already holds the longest start of its prompt, whose prefill then begins after
it (`Prefixes` keeps that account). An idle slot inside a step's span runs as a placeholder
row that attends over all its slot holds; one holding a conversation is first moved out of the
span (`_park`), so it stays cached without slowing the others. Engine work and sampling run in a
worker thread; slots, queues and cancellation are handled on the event loop alone.

Two bounds keep a busy server smooth and a quiet one small. A step's work is bounded
(`step_tokens`): the prompt chunk beside n decoding rows is step_tokens - n tokens (at least
MIN_CHUNK), so a new prompt delays every stream by a short step instead of a whole chunk. The
KV cache is one pool of `kv_positions` positions: a sequence is admitted while the prompts plus
max_tokens of the running ones fit it (else it waits its turn), idle slots' held prefixes are
let go, least recently used first, to make room, a slot's memory past what it holds goes back
to the system once its sequence ends (`Engine.release`, between steps only), and a held prefix
unused for `prefix_keep` seconds goes too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

import anyio
import numpy as np

from doel.serve.engine import Engine
from doel.serve.logprobs import Record, Scored, score_rows
from doel.serve.prefix import Hit, Prefixes
from doel.serve.sampling import SamplingParams, sample
from doel.serve.settings import Settings
from doel.serve.structured import Constraint, DeadEnd, fill_all
from doel.serve.tenants import ONE

DONE = -1  # end of a sequence in its queue
# The smallest prompt chunk a step takes beside decoding rows: below it, the weights read for a
# chunk cost more than its tokens (prefill times by chunk: benchmarks/results/profile_serve_*).
MIN_CHUNK = 8
log = logging.getLogger("doel.serve")


@dataclass(eq=False)
class Seq:
    prompt: list[int]
    params: SamplingParams
    context: np.ndarray  # prompt + completion ids so far, [context length]
    rng: np.random.Generator
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    n: int = 0  # ids in `context`
    slot: int = -1
    cancelled: bool = False
    fed: int = 0  # prompt ids in the slot's cache; the sequence decodes once all are
    record: Record | None = None  # log-probabilities asked for, written as the steps go
    hit: Hit = field(default_factory=Hit)  # prompt ids found in the slot's cache
    cache: Hashable | None = ONE  # the prefix cache's partition (tenants.partition)
    constraint: Constraint | None = None  # the output's grammar
    masked: bool = False  # the constraint's mask for the next token is computed

    @property
    def filling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def made(self) -> int:
        return self.n - len(self.prompt)


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        max_queue: int = Settings.max_queue,
        park: bool = True,
        kv_positions: int = Settings.kv_positions,
        step_tokens: int = Settings.step_tokens,
        prefix_keep: float = Settings.prefix_keep,
    ):
        self.engine, self.max_queue = engine, max_queue
        # The pool: 0 (or more) is every slot's whole context; a request past a smaller one is a
        # 400 (Service.check_fits).
        whole = engine.slots * engine.context_length
        self.kv_positions = min(kv_positions or whole, whole)
        self.step_tokens, self.prefix_keep = step_tokens, prefix_keep
        self.ended: set[int] = set()  # slots whose sequence ended: pages to give back
        self.idle_since: dict[int, float] = {}  # slot → when what it holds was last used
        self.park = park and engine.bundle.share_buffer  # held prefixes out of a step's span
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: dict[int, Seq] = {}  # slot → sequence
        self.prefixes = Prefixes(
            engine.slots, engine.context_length, enabled=engine.bundle.share_buffer
        )
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        record: Record | None = None,
        hit: Hit | None = None,
        cache: Hashable | None = ONE,
        constraint: Constraint | None = None,
    ) -> AsyncIterator[int]:
        """Token ids of one request as they come; raises QueueFull when too many wait. With
        `record`, each new id's log-probabilities are in it before the id is yielded (and the
        prompt's once it is in the cache, when the record asks for them); `hit` gets the
        number of prompt ids taken from a slot's cache before the first id comes, only ever
        from slots its partition `cache` wrote (None: none). With `constraint`, each id is one
        its grammar allows, and the sequence ends where the grammar does."""
        if len(self.waiting) >= self.max_queue and len(self.running) >= self.engine.slots:
            raise QueueFull(len(self.waiting))
        context = np.zeros(self.engine.context_length, np.int64)
        context[: len(prompt)] = prompt
        rng = np.random.default_rng(params.seed)
        seq = Seq(list(prompt), params, context, rng, n=len(prompt), record=record, cache=cache)
        seq.constraint = constraint
        seq.hit = hit if hit is not None else seq.hit
        self.waiting.append(seq)
        self._start()
        try:
            while (item := await seq.out.get()) != DONE:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            # Done, or a client gone: the slot is free for the next admission at once (a step
            # in flight took its own list of sequences and will not put this one back).
            seq.cancelled = True
            if self.running.get(seq.slot) is seq:
                del self.running[seq.slot]
                self._ended_at(seq.slot)
            self._wake.set()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._task.get_loop() is not loop:
            # A new event loop (tests run several): the event and the task belong to the old.
            self._wake, self._task = asyncio.Event(), None
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._settle()
            while self.waiting or self.running:
                self._drop_cancelled()
                self._settle()
                self._admit()
                if not self.running:
                    break
                # Not abandoned on cancellation: the engine's buffers are never used by two
                # runs at once.
                stepping = list(self.running.values())
                try:
                    events = await anyio.to_thread.run_sync(self._step, stepping)
                except Exception as e:  # a failed run ends its sequences, not the server
                    log.exception("engine step failed")
                    self._fail(stepping, e)
                    continue
                self._dispatch(events)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _fail(self, seqs: list[Seq], error: Exception) -> None:
        for s in seqs:
            s.out.put_nowait(RuntimeError(f"the engine failed: {error}"))
            if self.running.get(s.slot) is s:
                del self.running[s.slot]
                self._ended_at(s.slot)

    def _drop_cancelled(self) -> None:
        self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
        for slot in [k for k, s in self.running.items() if s.cancelled]:
            del self.running[slot]
            self._ended_at(slot)

    def _ended_at(self, slot: int) -> None:
        """On the event loop: `slot`'s sequence ended; its held prefix expires in prefix_keep
        seconds, when the loop wakes to give its memory back (`_settle`)."""
        self.ended.add(slot)
        self.idle_since[slot] = time.monotonic()
        asyncio.get_running_loop().call_later(self.prefix_keep + 0.01, self._wake.set)

    def _need(self, seq: Seq) -> int:
        """The positions a sequence may come to hold: its prompt and max_tokens more."""
        return min(len(seq.prompt) + seq.params.max_tokens, self.engine.context_length)

    def _settle(self) -> None:
        """Between steps: give back the memory of ended slots past what they hold, and all of
        a held prefix unused for prefix_keep seconds."""
        now = time.monotonic()
        for slot, since in list(self.idle_since.items()):
            if slot not in self.running and now - since >= self.prefix_keep:
                self._evict(slot)
        for slot in self.ended - set(self.running):
            self.engine.release(slot, len(self.prefixes.held[slot]))
        self.ended.clear()

    def _evict(self, slot: int) -> None:
        self.prefixes.forget(slot)
        self.idle_since.pop(slot, None)
        self.engine.release(slot, 0)

    def held_positions(self) -> int:
        """KV positions in use: the running sequences' and the idle slots' held prefixes."""
        running = sum(s.fed if s.filling else s.n for s in self.running.values())
        idle = (len(h) for i, h in enumerate(self.prefixes.held) if i not in self.running)
        return running + sum(idle)

    def _admit(self) -> None:
        free = [i for i in range(self.engine.slots) if i not in self.running]
        reserved = sum(self._need(s) for s in self.running.values())
        while self.waiting and free:
            seq = self.waiting[0]
            need = self._need(seq)
            if self.running and reserved + need > self.kv_positions:
                break  # it waits, first come first served, for running sequences to end
            self.waiting.popleft()
            # A prompt scored from its first token is computed whole.
            reuse = seq.record is None or not seq.record.prompt
            busy = tuple(self.running)
            seq.slot, seq.fed = self.prefixes.assign(seq.prompt, free, reuse, busy, seq.cache)
            seq.hit.tokens = seq.fed
            free.remove(seq.slot)
            self.idle_since.pop(seq.slot, None)
            self.running[seq.slot] = seq  # the rest of its prompt goes in over the next steps
            self.engine.release(seq.slot, seq.fed)  # what it held past the reused part
            reserved += need
            self._make_room(reserved, free)

    def _make_room(self, reserved: int, free: list[int]) -> None:
        """Let idle slots' held prefixes go, least recently used first, until they and the
        running sequences' reservations fit the pool."""
        held = {s: len(self.prefixes.held[s]) for s in free if self.prefixes.held[s]}
        for s in sorted(held, key=lambda s: self.prefixes.used[s]):
            if reserved + sum(held.values()) <= self.kv_positions:
                return
            self._evict(s)
            del held[s]

    def _step(self, stepping: list[Seq]) -> list[tuple[Seq, int | None, bool]]:
        """In a worker thread: one batched step of the decoding sequences, then prompt chunks
        of the filling ones in admission order (the dict keeps it) within the step's budget;
        sample. Chunks of prompts that arrive together run one after another, not batched: it
        saves little of their prefill and would hold back the first one's first token."""
        events = []
        decoding = [s for s in stepping if not s.filling]
        if decoding:
            # One run covers the slots from the lowest decoding one to the highest: a lone
            # stream in slot 2 is one row, not three (each row costs its share of attention,
            # over a held prefix too: benchmarks/results/profile_serve_0.4b_cpu-*.md).
            lo = min(s.slot for s in decoding)
            top = max(s.slot for s in decoding) + 1
            self._park(lo, top, {s.slot for s in stepping})
            # Other slots in between take a placeholder row. It writes one cache entry, past
            # what the slot holds: after an idle slot's cached prefix, or at the next position
            # of a filling one, which that prompt's next chunk overwrites before anything reads.
            tokens = [0] * (top - lo)
            totals = [self.prefixes.idle_total(i) for i in range(lo, top)]
            for s in stepping:
                if lo <= s.slot < top:
                    tokens[s.slot - lo] = int(s.context[s.n - 1]) if not s.filling else 0
                    totals[s.slot - lo] = s.n if not s.filling else s.fed + 1
            # The grammar rows' masks are computed on a thread of their own while the model
            # runs (llguidance lets go of the GIL); rows without a format add nothing.
            constrained = [s for s in decoding if s.constraint is not None]
            masks = fill_all([s.constraint for s in constrained]) if constrained else None
            logits = self.engine.decode(tokens, totals, lo)
            if masks is not None:
                masks.result()
                for s in constrained:
                    s.masked = True
            for s in decoding:
                self.prefixes.wrote(s.slot, s.n - 1, [int(s.context[s.n - 1])])
            events += [self._pick(s, logits[s.slot - lo]) for s in decoding]
        # Prompt chunks, oldest prompt first, within what the decoding rows left of the step's
        # budget: a lone prompt gets a whole chunk; prompts that wait together share a step.
        budget = self.step_tokens - len(decoding)
        for i, s in enumerate(x for x in stepping if x.filling):
            if i and budget < MIN_CHUNK:
                break
            size = min(self.engine.prefill_chunk, max(MIN_CHUNK, budget))
            if not decoding and not i:
                size = self.engine.prefill_chunk
            budget -= self._fill(s, size, events)
        return events

    def _fill(self, s: Seq, size: int, events: list) -> int:
        """In the worker thread: the next `size` prompt ids of `s` into its slot, and its first
        new id once the prompt is in; the number of ids fed."""
        chunk = s.prompt[s.fed : s.fed + size]
        scored = s.record is not None and s.record.prompt
        logits = self.engine.forward(chunk, s.fed, slot=s.slot, every=scored)
        self.prefixes.wrote(s.slot, s.fed, chunk)
        if scored:
            # Row r predicts prompt token fed + r + 1; the last row of the last chunk
            # predicts the first new token instead (scored when it is picked).
            if s.fed == 0:
                s.record.entries.append(None)  # the first token has no context
            targets = s.prompt[s.fed + 1 : s.fed + len(chunk) + 1]
            s.record.entries += score_rows(logits, targets, s.record.top)
            logits = logits[-1]
        s.fed += len(chunk)
        if not s.filling:
            if s.params.max_tokens == 0:  # the prompt scored, nothing to generate
                events.append((s, None, True))
            else:
                events.append(self._pick(s, logits))
        return len(chunk)

    def _park(self, lo: int, top: int, busy: set[int]) -> None:
        """In the worker thread, before a step of slots lo..top-1: move what idle slots among
        them hold to free slots outside (`Prefixes` says where, and when it pays), so
        their placeholder rows attend over one entry, not over a held conversation. Only the
        worker writes the cache, and no admission happens during a step."""
        if not self.park:
            return
        for slot in range(lo, top):
            if slot in busy:
                continue
            dst = self.prefixes.parking(slot, lo, top, busy)
            if dst is not None:
                self.engine.copy_slot(slot, dst, len(self.prefixes.held[slot]))
                self.prefixes.moved(slot, dst)
                self.engine.release(slot, 0)
                if slot in self.idle_since:
                    self.idle_since[dst] = self.idle_since.pop(slot)

    def _pick(self, s: Seq, logits: np.ndarray) -> tuple[Seq, int | None, bool]:
        """Sample the next id; (sequence, id or None at a stop id, finished)."""
        p, c = s.params, s.constraint
        if c is not None:
            try:
                return self._pick_constrained(s, c, logits)
            except DeadEnd as e:  # the grammar ends here unfinished: "length", as a cut would
                log.warning("grammar dead end, the request ends unfinished: %s", e)
                return s, None, True
            except RuntimeError as e:  # a matcher in error: this sequence fails, not the step
                log.error("grammar failed: %s", e)
                return s, e, True
        token = sample(logits, p, s.rng, s.context[: s.n], s.context[len(s.prompt) : s.n])
        if token in p.stop_token_ids:
            return s, None, True
        return self._took(s, token, logits)

    def _pick_constrained(self, s: Seq, c: Constraint, logits: np.ndarray):
        """`_pick` of a row with a grammar: its logits masked to the tokens the grammar
        allows (the stop ids only where it accepts), and the sequence ended where it ends."""
        p = s.params
        if not s.masked:  # the first token, after the prompt's last chunk
            c.fill()
        s.masked = False
        logits = c.mask(logits, p.stop_token_ids)
        token = sample(logits, p, s.rng, s.context[: s.n], s.context[len(s.prompt) : s.n])
        if token in p.stop_token_ids:
            c.advance(None)
            return s, None, True
        c.advance(token)
        s, token, full = self._took(s, token, logits)
        if s.record is not None:  # tokens the grammar forbids are no alternatives (-inf)
            last = s.record.entries[-1]
            keep = [k for k, v in enumerate(last.top_logprobs) if v != -np.inf]
            ids = tuple(last.top_ids[k] for k in keep)
            values = tuple(last.top_logprobs[k] for k in keep)
            s.record.entries[-1] = Scored(last.logprob, ids, values)
        return s, token, full or c.done

    def _took(self, s: Seq, token: int, logits: np.ndarray) -> tuple[Seq, int, bool]:
        """Record a picked id; finished when max_tokens or the context is reached."""
        p = s.params
        if s.record is not None:
            s.record.entries += score_rows(logits, [token], s.record.top)
        s.context[s.n] = token
        s.n += 1
        return s, token, s.made >= p.max_tokens or s.n >= self.engine.context_length

    def _dispatch(self, events) -> None:
        for s, token, finished in events:
            if isinstance(token, Exception):
                s.out.put_nowait(RuntimeError(f"structured output failed: {token}"))
            elif token is not None:
                s.out.put_nowait(token)
            if finished:
                s.out.put_nowait(DONE)
                if self.running.get(s.slot) is s:
                    del self.running[s.slot]
                    self._ended_at(s.slot)
            elif not s.cancelled:
                self.running[s.slot] = s
