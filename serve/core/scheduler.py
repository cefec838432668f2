"""Continuous batching on an engine thread of its own: concurrent requests share decode steps.

Each request gets a slot of the engine's cache. One thread owns the engine and every account of
it (slots, the pool, the prefix cache) and runs steps while there is work (`step.Steps`): every
sequence whose ids are in its slot advances by one token in a single batched run, so the weights
are read once per step for all of them, and prompts go in by chunks within the step's budget. The
event loop only submits and aborts (`submit` → `Handle`, `Handle.abort`, both thread-safe and
the abort idempotent) and reads what the thread posts to each request's queue: the engine is
paced by itself, not by the loop's turn between parsing bodies and writing SSE (vLLM V1 keeps its
engine core apart from the API process for the same reason). `generate` owns its handle in one
try/finally, so a client gone, a stop string or a failure frees the slot at the next step.

The KV cache is one pool of `kv_positions` positions, taken as sequences grow (the engine gives a
slot's memory back as it ends: docs/serving.md#memory). A request is admitted when a slot is free
and its prompt, plus one step's growth of every running sequence, fits beside what they hold;
idle slots' held prefixes are let go, least recently used first, to make room. When the running
sequences outgrow the pool, the youngest is preempted (vLLM's recompute): its slot is given back,
it waits at the head of the queue, and once admitted again it refills its prompt and the ids it
had made, then decodes on; the client sees only a pause. A request is never reserved its
`max_tokens` up front, so chats that send none run as many at once as their use allows.

Nothing the thread does between steps can end it: an error in admission, settling or dispatch
fails the sequences it held, each with the error, and the thread carries on (issue 53, item 11).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

import numpy as np

from doel.serve.core.engine import Engine
from doel.serve.core.logprobs import Record
from doel.serve.core.prefix import Hit, Prefixes
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.step import StepFailed, Steps
from doel.serve.core.structured import Constraint
from doel.serve.edge.tenants import ONE
from doel.serve.settings import Settings

DONE = -1  # end of a sequence in its queue
IDLE_EXIT = 1.0  # seconds an engine thread with nothing to do or expire waits before it ends
log = logging.getLogger("doel.serve")


@dataclass(eq=False)
class Seq:
    prompt: list[int]
    params: SamplingParams
    context: np.ndarray  # prompt + completion ids so far, [context length]
    rng: np.random.Generator
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None  # whose queue `out` is
    n: int = 0  # ids in `context`
    slot: int = -1
    cancelled: bool = False
    fed: int = 0  # ids of `context` in the slot's cache; it decodes once `target` are
    target: int = 0  # ids to have in the cache: the prompt, or after preemption n - 1
    admitted: int = 0  # admission order: the youngest is preempted first
    preempted: int = 0  # times it gave its slot back
    record: Record | None = None  # log-probabilities asked for, written as the steps go
    hit: Hit = field(default_factory=Hit)  # prompt ids found in the slot's cache
    cache: Hashable | None = ONE  # the prefix cache's partition (tenants.partition)
    constraint: Constraint | None = None  # the output's grammar
    masked: bool = False  # the constraint's mask for the next token is computed

    @property
    def filling(self) -> bool:
        return self.fed < self.target

    @property
    def made(self) -> int:
        return self.n - len(self.prompt)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On an event loop: a step's items into their requests' queues."""
    for queue, item in items:
        queue.put_nowait(item)


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Handle:
    """A submitted request: `abort()` (idempotent, any thread) ends it at the next step."""

    seq: Seq
    scheduler: Scheduler

    def abort(self) -> None:
        if not self.seq.cancelled:
            self.seq.cancelled = True
            self.scheduler._notify()


class Scheduler(Steps):
    def __init__(
        self,
        engine: Engine,
        max_queue: int = Settings.max_queue,
        park: bool = True,
        kv_positions: int = Settings.kv_positions,
        step_tokens: int = Settings.step_tokens,
        prefix_keep: float = Settings.prefix_keep,
        draft_tokens: int = Settings.draft_tokens,
    ):
        self.engine, self.max_queue = engine, max_queue
        # The pool: 0 is every slot's whole context (Service.load bounds it by memory); a
        # request past a smaller one is a 400 (Service.check_fits).
        whole = engine.slots * engine.context_length
        self.kv_positions = min(kv_positions or whole, whole)
        self.step_tokens, self.prefix_keep = step_tokens, prefix_keep
        self.draft_tokens = draft_tokens  # a lone sequence's prompt-lookup draft (step.py)
        self.drafted = self.accepted = 0  # draft ids verified, and of those kept
        self.ended: set[int] = set()  # slots whose sequence ended: pages to give back
        self.idle_since: dict[int, float] = {}  # slot → when what it holds was last used
        self.park = park and engine.bundle.share_buffer  # held prefixes out of a step's span
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: dict[int, Seq] = {}  # slot → sequence
        self.prefixes = Prefixes(
            engine.slots, engine.context_length, enabled=engine.bundle.share_buffer
        )
        self.preemptions = 0
        self.pool_bound = False  # the last admission stopped for the pool, not for a slot
        self._inbox: collections.deque[Seq] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._admissions = 0
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}

    # -- the event loop's side ---------------------------------------------------------------

    def submit(self, seq: Seq) -> Handle:
        """Queue `seq` for the engine thread; QueueFull when `max_queue` already wait (more
        where free slots will take them at once: a burst is not refused for arriving together)."""
        with self._cond:
            waiting = len(self.waiting) + len(self._inbox)
            free = 0 if self.pool_bound else self.engine.slots - len(self.running)
            if waiting >= self.max_queue + max(free, 0):
                raise QueueFull(waiting)
            self._inbox.append(seq)
            if self._thread is None:
                self._closed = False
                self._thread = threading.Thread(target=self._run, name="doel-engine", daemon=True)
                self._thread.start()
            self._cond.notify()
        return Handle(seq, self)

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
        context = np.zeros(self.engine.context_length, np.int64)
        context[: len(prompt)] = prompt
        rng = np.random.default_rng(params.seed)
        seq = Seq(list(prompt), params, context, rng, n=len(prompt), record=record, cache=cache)
        seq.target, seq.constraint, seq.loop = len(prompt), constraint, asyncio.get_running_loop()
        seq.hit = hit if hit is not None else seq.hit
        handle = self.submit(seq)
        try:
            while (item := await seq.out.get()) != DONE:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:  # done, failed, or a client gone: the slot is free at the next step
            handle.abort()

    async def close(self) -> None:
        """Stop the engine thread (it finishes the step it is in); safe to call twice."""
        with self._cond:
            self._closed = True
            thread, self._thread = self._thread, None
            self._cond.notify()
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while self._next_work():
            try:
                self._drop_cancelled()
                self._settle()
                self._admit()
                self._fit_pool()
                if self.running:
                    self._dispatch(self._step(list(self.running.values())))
            except Exception as e:  # not the step's own failures (step.py): fail, carry on
                log.exception("the scheduler failed between steps")
                self._fail_all(e)

    def _next_work(self) -> bool:
        """Wait for something to do: a request, a step to run, a held prefix to expire. False
        once closed, or after IDLE_EXIT seconds with nothing at all (the thread ends; the next
        `submit` starts another)."""
        with self._cond:
            while not self._closed:
                self.waiting.extend(self._inbox)
                self._inbox.clear()
                if self.running or self.waiting or self.ended:
                    return True
                expiry = self._next_expiry()
                if expiry is not None and expiry <= 0:
                    return True
                if not self._cond.wait(IDLE_EXIT if expiry is None else expiry):
                    if expiry is None and not self._inbox:  # nothing came, nothing held
                        self._thread = None
                        return False
            return False

    def _next_expiry(self) -> float | None:
        """Seconds until the oldest idle slot's held prefix expires, or None."""
        if not self.idle_since:
            return None
        return min(self.idle_since.values()) + self.prefix_keep - time.monotonic()

    def _fail_all(self, error: Exception) -> None:
        """After an error outside a step: every sequence held ends with it, its slot freed."""
        for s in dict.fromkeys([*self.running.values(), *self.waiting]):
            self._post(s, StepFailed(f"the server failed: {error}"))
            self._post(s, DONE)
            s.cancelled = True
        for slot in list(self.running):
            self.prefixes.forget(slot)
            self.engine.release(slot, 0)
        self.running.clear()
        self.waiting.clear()
        self._flush()

    def _drop_cancelled(self) -> None:
        self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
        for slot in [k for k, s in self.running.items() if s.cancelled]:
            self._end(slot)

    def _end(self, slot: int) -> None:
        """`slot`'s sequence ended: its pages past the held prefix go back after this step, all
        of them once it has been idle for prefix_keep seconds."""
        del self.running[slot]
        self.ended.add(slot)
        self.idle_since[slot] = time.monotonic()

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
        return running + self._idle_held()

    def _idle_held(self) -> int:
        return sum(len(h) for i, h in enumerate(self.prefixes.held) if i not in self.running)

    def _used(self) -> int:
        """Positions the running sequences hold after the next step: each one's ids (a
        filling one's whole prompt, so that a prompt, once admitted, always fits)."""
        return sum(max(s.n, s.target) for s in self.running.values())

    def _admit(self) -> None:
        free = [i for i in range(self.engine.slots) if i not in self.running]
        self.pool_bound = False
        while self.waiting and free:
            seq = self.waiting[0]
            # Its ids, and one step's growth of every running sequence and its own.
            need = self._used() + max(seq.n, seq.target) + len(self.running) + 1
            if not self._make_room(need, free) and self.running:
                self.pool_bound = True
                break  # it waits, first come first served, for running sequences to end
            self._place(seq, free)  # then out of the queue: an error meanwhile still reaches it
            self.waiting.popleft()

    def _place(self, seq: Seq, free: list[int]) -> None:
        # A prompt scored from its first token is computed whole.
        reuse = seq.record is None or not seq.record.prompt
        busy = tuple(self.running)
        ids = [int(i) for i in seq.context[: seq.target]]
        seq.slot, seq.fed = self.prefixes.assign(ids, free, reuse, busy, seq.cache)
        if not seq.preempted:
            seq.hit.tokens = seq.fed
        free.remove(seq.slot)
        self.idle_since.pop(seq.slot, None)
        self._admissions += 1
        seq.admitted = self._admissions
        self.running[seq.slot] = seq  # the rest of its ids go in over the next steps
        self.engine.release(seq.slot, seq.fed)  # what it held past the reused part

    def _make_room(self, need: int, free: list[int]) -> bool:
        """Let idle slots' held prefixes go, least recently used first, until `need` positions
        and what stays held fit the pool; whether they do."""
        held = {s: len(self.prefixes.held[s]) for s in free if self.prefixes.held[s]}
        for s in sorted(held, key=lambda s: self.prefixes.used[s]):
            if need + sum(held.values()) <= self.kv_positions:
                return True
            self._evict(s)
            del held[s]
        return need + sum(held.values()) <= self.kv_positions

    def _fit_pool(self) -> None:
        """Before a step: while the running sequences would outgrow the pool, let idle held
        prefixes go, then preempt the youngest sequence (never the last one running)."""
        free = [i for i in range(self.engine.slots) if i not in self.running]
        while not self._make_room(self._used(), free) and len(self.running) > 1:
            self._preempt(max(self.running.values(), key=lambda s: s.admitted))
            free = [i for i in range(self.engine.slots) if i not in self.running]

    def _preempt(self, s: Seq) -> None:
        """`s` gives its slot back and waits first in line; admitted again, it refills the ids
        it had (the ones it made too) before it decodes on."""
        del self.running[s.slot]
        self.prefixes.forget(s.slot)
        self.engine.release(s.slot, 0)
        s.slot, s.fed, s.masked = -1, 0, False
        s.target = s.n - 1 if s.made else len(s.prompt)
        if s.record is not None and s.record.prompt and not s.made:
            s.record.entries.clear()  # its prompt is scored again as it goes in again
        s.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(s)

    def _dispatch(self, events) -> None:
        for s, token, finished in events:
            if token is not None:  # an id, or the error that ended it
                self._post(s, token)
            if finished:  # its slot is free before the client hears that it ended
                if self.running.get(s.slot) is s:
                    self._end(s.slot)
                self._post(s, DONE)
        self._flush()

    def _post(self, s: Seq, item) -> None:
        """`item` for the request's queue, sent with the step's others (`_flush`)."""
        if s.loop is not None and not s.cancelled:
            self._outbox.setdefault(s.loop, []).append((s.out, item))

    def _flush(self) -> None:
        """What the step made, to each event loop in one call: one wake-up a step, not one a
        token (a loop that is closed has nobody reading)."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)
