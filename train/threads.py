"""How many intra-op threads a CPU run steps with: a short measured choice, kept up to date.

torch starts one OpenMP thread per core. On a quiet machine that is the fastest; on a busy one
(a laptop with a browser open, a shared 2-core box) it can be several times slower than one
thread: every parallel region waits until all its threads are scheduled, and a thread that
spins waiting for a descheduled peer burns the slice it was given (the demo's training beside a
busy neighbour: benchmarks/results/demo_load_intel-avx512-amx.md). Which count wins depends on
the load, so it is measured on the run's own steps, not guessed: a few steps at each count,
the faster kept, measured again when the step time drifts (the load changed) and now and then.
No step is wasted: the probe steps are training steps.

Off when OMP_NUM_THREADS is set (the user chose, and a run is then bit-for-bit reproducible:
the thread count changes floating-point summation order), under torchrun (each rank keeps its
share), on an accelerator, and when torch already runs one thread.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

WINDOW = 3  # steps timed at each count; their median ignores a validation or checkpoint step
WARMUP = 2  # the first steps (allocation, compile) say nothing about the steady state
DRIFT = 0.3  # a median step time this much off the chosen one means the load changed
RECHECK = 100  # steps between checks when nothing drifted; doubles while the choice stands
GAP = 20  # steps at least between checks, however noisy the load
CUT = 2.0  # a probed count this many times slower than the best so far needs no more steps


def wanted(device: torch.device, distributed: bool, env=os.environ) -> bool:
    """Whether the measured choice applies to this run (see the module's docstring)."""
    return (
        device.type == "cpu"
        and not distributed
        and not env.get("OMP_NUM_THREADS", "").strip()
        and torch.get_num_threads() > 1
    )


class ThreadChooser:
    """A step hook: times each step (the interval between calls) and sets torch's thread count.
    `candidates` are the counts tried, the default (all cores) first. `then` is the caller's own
    hook, called first. `clock` and `set_threads` are replaceable for tests."""

    def __init__(
        self,
        candidates: list[int],
        log: Callable[[str], object] = print,
        then: Callable[[int], object] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Callable[[int], object] = torch.set_num_threads,
    ):
        self.candidates, self.log, self.then = candidates, log, then
        self.clock, self.set_threads = clock, set_threads
        self.times: dict[int, list[float]] = {n: [] for n in candidates}
        self.current, self.chosen = candidates[0], None
        self.reference = 0.0  # the chosen count's median step time when it was chosen
        self.recent: list[float] = []
        self.probing = list(candidates)  # counts still to time in this round
        self.since, self.seen, self.last = 0, 0, None
        self.recheck = RECHECK

    def __call__(self, step: int) -> None:
        if self.then is not None:
            self.then(step)
        now = self.clock()
        last, self.last = self.last, now
        self.seen += 1
        if last is None or self.seen <= WARMUP:
            return
        self._record(now - last)

    def _record(self, dt: float) -> None:
        if self.probing:
            bucket = self.times[self.current]
            bucket.append(dt)
            done = [statistics.median(ts) for n, ts in self.times.items() if n not in self.probing]
            # one step is enough to rule out a count that is far slower: under load two
            # threads can be 15 times slower than one, and each probe step costs that
            if len(bucket) >= WINDOW or (done and dt > CUT * min(done)):
                self.probing.remove(self.current)
                if self.probing:
                    self._use(self.probing[0])
                else:
                    self._choose()
            return
        self.since += 1
        self.recent = (self.recent + [dt])[-WINDOW:]
        drifted = (
            len(self.recent) == WINDOW
            and abs(statistics.median(self.recent) / self.reference - 1) > DRIFT
        )
        if (drifted and self.since >= GAP) or self.since >= self.recheck:
            self._start_round()

    def _start_round(self) -> None:
        self.times = {n: [] for n in self.candidates}
        # the current count first: its time now, then the others, compared under one load
        self.probing = [self.current] + [n for n in self.candidates if n != self.current]
        self.recent, self.since, self.last = [], 0, None  # the next interval spans the switch

    def _use(self, n: int) -> None:
        self.current = n
        self.set_threads(n)
        self.last = None  # the interval that spans the switch belongs to neither count

    def _choose(self) -> None:
        medians = {n: statistics.median(ts) for n, ts in self.times.items()}
        best = min(medians, key=medians.get)
        if best != self.chosen:
            others = ", ".join(f"{n}: {medians[n]:.3f} s" for n in medians if n != best)
            self.log(
                f"threads: {best} ({medians[best]:.3f} s a step; {others}), measured on this "
                "machine's load; set OMP_NUM_THREADS to fix the count"
            )
        # a choice that stood is checked less often; a changed one soon again
        self.recheck = min(2 * self.recheck, 8 * RECHECK) if best == self.chosen else RECHECK
        self.chosen, self.reference = best, medians[best]
        if self.current != best:
            self._use(best)


def thread_hook(device, distributed: bool, log, then=None):
    """The step hook a run steps with: a ThreadChooser over all cores and one thread when the
    choice applies (`wanted`), else `then` unchanged."""
    if not wanted(device, distributed):
        return then
    n = torch.get_num_threads()
    candidates = [n, 1] if n <= 3 else [n, n // 2, 1]
    return ThreadChooser(candidates, log=log, then=then)
