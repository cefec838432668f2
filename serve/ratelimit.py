"""Each client's rate of REQUESTS (--client-request-rate), asked by the Guard (serve/guard.py)
before it reads a body or routes anything: a token bucket per client, and a request past it is
refused at once with 429 and Retry-After, the cheapest answer the server has.

Why: serve/limits.py's BodyBudget paces large bodies, but a flood of small requests (GET /health,
tiny bad requests) costs the event loop that serves every client per request, not per byte:
six clients looping /health, bad JSON and a wrong key back to back slowed another's 7 ms chat
to 81-89 ms.

A client is what BodyBudget's is (its API key's tenant, else its address). Probes (/health,
/metrics) are counted in a bucket of their own: an orchestrator polling /health from an address
whose other requests are over the rate still sees the server up. Probes are the cheapest
requests there are (no body, no model), and tools that measure a server's responsiveness poll
/health every few milliseconds (tests/serve/test_abuse.py asks it every 2 ms), so their rate is
PROBE_FACTOR times the API's, with a burst of one second of it: still bounded, and a flood of
/health is held like any other (tests/serve/test_ratelimit.py measures one beside a chat).

Refusing is not enough by itself: a client that sends its next request as soon as the 429
arrives still costs the event loop its parsing and answer, and six such clients slowed another's
7 ms chat to 70 ms though each was refused before routing. So the 429 is sent at once, and then
the connection it went out on reads nothing more until its Retry-After (serve/limits.py's
protocol, told by the Guard through scope[HOLD]): a client that honours Retry-After never sees
the difference, one that does not waits anyway, unanswered and costing nothing (8.6 ms beside
the same flood). Held connections count towards --max-connections (as idle ones already could,
up to --timeout-read), so past half of it a refused connection is closed instead. A client that
opens a new connection for every request is not slowed by the hold, and still costs an accept
and a parse each (57 ms beside the chat): that is for a firewall's or a proxy's connection rate.
"""

from __future__ import annotations

import math
import time

# 50 requests a second, a burst of 10 s of them. No normal client meets it: a person, a chat
# page or an agent waits for each answer, and the 0.4B model decodes tens of tokens a second on
# a CPU, so even a client with several requests in flight sends a few a second. A scripted
# client sending many at once (an evaluation harness, 200 concurrent requests in
# tests/serve/test_live.py) fits in the burst. A flood meets it within seconds, and from then on
# does work at 50 a second, the rest refused before routing.
DEFAULT_REQUEST_RATE = 50
BURST_SECONDS = 10.0
PROBE_PATHS = ("/health", "/metrics")  # their own bucket per client: see the docstring
PROBE_FACTOR = 10  # a probe's rate, in API rates: 500 a second by default, one every 2 ms
# Where the Guard puts a refused request's Retry-After, in seconds: serve/limits.py's connection
# then reads nothing more from that client for so long (see the docstring).
HOLD = "doel.hold"


class Buckets:
    """Token buckets, one a client: each refills at `rate` a second up to `burst`. Clients whose
    bucket is full again are forgotten (one scan per so many remembered). The shared mechanism
    of RequestRate and serve/limits.py's BodyBudget."""

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
