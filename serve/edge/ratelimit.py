"""Each client's rates, as token buckets (`Buckets`): its REQUESTS (`RequestRate`,
--client-request-rate), refused past it with 429 and Retry-After before a body is read or
anything routed, the cheapest answer the server has; and its BODY BYTES (`BodyBudget`,
--client-body-rate), a large body past it waiting, unread, for the client's turn. The Guard asks
both; a client is its API key's tenant, else its address.

Why: the event loop serves every client, and a flood costs it per request (small ones) or per
byte (JSON bodies are parsed on it), so one client's flood would slow everyone's chat. Probes
(/health, /metrics) have a bucket of their own, PROBE_FACTOR times faster, so that an
orchestrator polling from a flooding address still sees the server up. A refused client's
connection then reads nothing until its Retry-After (scope[HOLD], which the connection reads),
so one that does not honour it waits anyway, costing nothing. Bodies up to SMALL_BODY never
wait: a client's chats are not held behind its own large bodies. The figures behind these
choices are docs/serving.md's, measured by tests/serve/edge/test_ratelimit.py and test_shared.py.
"""

from __future__ import annotations

import math
import time

BURST_SECONDS = 10.0  # a request rate's burst, in seconds of it: a harness's batch fits in it
PROBE_PATHS = ("/health", "/metrics")  # their own bucket per client: see the docstring
PROBE_FACTOR = 10  # a probe's rate, in API rates: tools poll /health every few milliseconds
# Where the Guard puts a refused request's Retry-After, in seconds: the connection then reads
# nothing more from that client for so long.
HOLD = "doel.hold"
SMALL_BODY = 16 * 1024  # bytes of a body that never waits: a chat's, which costs no parsing
MAX_BODY_WAIT = 10.0  # seconds a body may wait for its client's rate; longer: 429


class Buckets:
    """Token buckets, one a client: each refills at `rate` a second up to `burst`. Clients whose
    bucket is full again are forgotten (one scan per so many remembered). The shared mechanism
    of RequestRate and BodyBudget."""

    def __init__(self, rate: float, burst: float, clock=None):
        self.rate, self.burst = rate, burst
        self.clock = clock or time.monotonic
        self.buckets: dict[object, tuple[float, float]] = {}  # client -> (saved, when)
        self.prune_at = 4096  # clients remembered before those gone quiet are looked for

    def level(self, client, now: float) -> float:
        """What the client's bucket holds at `now`."""
        saved, when = self.buckets.get(client, (self.burst, now))
        return min(self.burst, saved + (now - when) * self.rate)

    def keep(self, client, level: float, now: float) -> None:
        """The client's bucket holds `level` at `now` (below zero: a debt to wait out)."""
        self.buckets[client] = (level, now)
        if len(self.buckets) > self.prune_at:  # clients gone quiet are full again: forget them
            full = [
                c for c, (n, w) in self.buckets.items() if n + (now - w) * self.rate >= self.burst
            ]
            for c in full:
                del self.buckets[c]
            self.prune_at = max(4096, 2 * len(self.buckets))


class RequestRate(Buckets):
    """A token bucket of requests per client: `rate` a second, up to `burst` saved (default
    BURST_SECONDS of rate). `take` passes a request (0) or says in whole seconds when the next
    would pass (nothing taken)."""

    def __init__(self, rate: float, burst: float | None = None, clock=None):
        if rate <= 0:
            raise ValueError(f"a request rate must be over 0, not {rate}")
        burst = max(1.0, burst if burst is not None else BURST_SECONDS * rate)
        super().__init__(rate, burst, clock)

    def take(self, client) -> int:
        """0: the request passes (one taken from the client's bucket); else the whole seconds,
        at least 1, until one would pass: its Retry-After."""
        now = self.clock()
        saved = self.level(client, now)
        if saved < 1:
            self.keep(client, saved, now)
            return max(1, math.ceil((1 - saved) / self.rate))
        self.keep(client, saved - 1, now)
        return 0


class ClientRates:
    """Each client's two buckets: its API requests at `rate` a second, its probes (PROBE_PATHS)
    at PROBE_FACTOR times that, with a burst of one second of them."""

    def __init__(self, rate: float, clock=None):
        self.api = RequestRate(rate, clock=clock)
        fast = PROBE_FACTOR * rate
        self.probes = RequestRate(fast, burst=fast, clock=clock)

    def of(self, path: str) -> RequestRate:
        return self.probes if path in PROBE_PATHS else self.api


class BodyBudget(Buckets):
    """A token bucket of body bytes per client: `rate` a second, up to `burst` saved. A body
    is charged at once (the bucket may go below zero: the bodies behind it wait their turn).
    `charge` returns the seconds to wait before the body is read, or None when that would be
    over `max_wait` (nothing charged: the caller refuses it)."""

    def __init__(self, rate: float, burst: int, max_wait: float = MAX_BODY_WAIT, clock=None):
        super().__init__(rate, burst, clock)
        self.max_wait = max_wait

    def charge(self, client, size: int) -> float | None:
        now = self.clock()
        saved = self.level(client, now)
        wait = 0.0 if size <= SMALL_BODY else max(0.0, (size - saved) / self.rate)
        if wait > self.max_wait:
            return None
        self.keep(client, saved - size, now)
        return wait

    def retry_after(self, client, size: int) -> int:
        """Whole seconds until `size` bytes would pass without waiting over max_wait."""
        saved = self.level(client, self.clock())
        return max(1, math.ceil((size - saved) / self.rate - self.max_wait))
