"""Prometheus text exposition for GET /metrics, without the client library (one dependency less):
requests by route (the app's own routes, read from its router: see CountRequests) and status,
tokens in and out, time to first token, decode speed, queue depth, open connections and those
refused below HTTP (`Refusals`: timeouts, over the limit), and each model's state (loaded,
loading, unloaded or failed: serve/core/models.py) and loads.

A request is counted when its response has ended, under the status it ended with: a stream's
head says 200 before its first event, but a stream that an error event ended is counted as the
error (500, or the refusal's status), and one whose client left or stopped reading as 499 (the
response sets `ENDED` in its scope: serve/edge/answer.py), so that /metrics shows the failures a
200 would hide.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable

from starlette.routing import Match

MODEL_STATES = ("loaded", "loading", "unloaded", "failed")  # a model's (serve/core/models.py)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The scope key of the status a streamed response ended with, where it is not its head's.
ENDED = "doel.ended"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of those, taken from a slot's cache
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.decode_seconds = 0.0  # time spent on tokens after the first
        self.decode_tokens = 0
        self.last_tokens_per_second = 0.0
        self.connections_open = 0
        self.refused: Counter[str] = Counter()  # by kind, counted by serve.limits.Refusals

    def completion(
        self, prompt: int, generated: int, ttft: float, total: float, cached: int = 0
    ) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.generated_tokens += generated
        if generated > 1 and total > ttft:
            self.decode_seconds += total - ttft
            self.decode_tokens += generated - 1
            self.last_tokens_per_second = (generated - 1) / (total - ttft)

    def render(
        self,
        waiting: int,
        running: int,
        models: Iterable[tuple[str, str, int]] = (),
        drafts: tuple[int, int] = (0, 0),
    ) -> str:
        """The exposition; `models`: (name, state, loads) of each model; `drafts`: the draft ids
        the loaded models verified, and of those kept (serve/core/lookup.py)."""

        def block(name: str, kind: str, help_: str, lines: list[str]) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines]

        reqs = [
            f'doel_requests_total{{route="{r}",status="{s}"}} {n}'
            for (r, s), n in sorted(self.requests.items())
        ]
        rate = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
        out = [
            *block("doel_requests_total", "counter", "HTTP requests by route and status", reqs),
            *block(
                "doel_prompt_tokens_total",
                "counter",
                "prompt tokens processed",
                [f"doel_prompt_tokens_total {self.prompt_tokens}"],
            ),
            *block(
                "doel_prompt_tokens_cached_total",
                "counter",
                "prompt tokens found in a slot's KV cache instead of being prefilled",
                [f"doel_prompt_tokens_cached_total {self.cached_tokens}"],
            ),
            *block(
                "doel_generation_tokens_total",
                "counter",
                "tokens generated",
                [f"doel_generation_tokens_total {self.generated_tokens}"],
            ),
            *block(
                "doel_time_to_first_token_seconds",
                "histogram",
                "from a request's arrival to its first token (waiting for a slot included)",
                self.ttft.lines("doel_time_to_first_token_seconds"),
            ),
            *block(
                "doel_decode_tokens_per_second",
                "gauge",
                "decode speed over all completions (tokens after the first)",
                [f"doel_decode_tokens_per_second {rate}"],
            ),
            *block(
                "doel_queue_depth",
                "gauge",
                "requests waiting for the engine",
                [f"doel_queue_depth {waiting}"],
            ),
            *block(
                "doel_requests_running",
                "gauge",
                "requests on the engine",
                [f"doel_requests_running {running}"],
            ),
            *block(
                "doel_connections_open",
                "gauge",
                "HTTP connections open",
                [f"doel_connections_open {self.connections_open}"],
            ),
            *block(
                "doel_connections_refused_total",
                "counter",
                "connections closed or refused before the app (read timeout, over the limit...)",
                [
                    f'doel_connections_refused_total{{reason="{k}"}} {n}'
                    for k, n in sorted(self.refused.items())
                ],
            ),
            *block(
                "doel_draft_tokens_total",
                "counter",
                "prompt-lookup draft ids verified by the loaded models",
                [f"doel_draft_tokens_total {drafts[0]}"],
            ),
            *block(
                "doel_draft_tokens_accepted_total",
                "counter",
                "of those, ids the model picked too (kept)",
                [f"doel_draft_tokens_accepted_total {drafts[1]}"],
            ),
            *model_lines(list(models)),
        ]
        return "\n".join(out) + "\n"


def model_lines(models: list[tuple[str, str, int]]) -> list[str]:
    """Each model's state as a gauge of 1 on its state's line and 0 on the others (a scrape sees
    one line change), and its loads so far: a model loaded again after an idle unload counts 2."""
    states = [
        f'doel_model_state{{model="{name}",state="{s}"}} {int(s == state)}'
        for name, state, _ in models
        for s in MODEL_STATES
    ]
    loads = [f'doel_model_loads_total{{model="{name}"}} {n}' for name, _, n in models]
    return [
        "# HELP doel_model_state each model's state: loaded, loading, unloaded or failed",
        "# TYPE doel_model_state gauge",
        *states,
        "# HELP doel_model_loads_total times each model was loaded",
        "# TYPE doel_model_loads_total counter",
        *loads,
    ]


class CountRequests:
    """ASGI middleware: counts every response, once it has ended, by route and the status it
    ended with (the module's docstring says why that is not always its head's). The route is
    the path of the app's route that the request names (its template, for a path with
    parameters), read from the app's router, so that each endpoint is counted under its own
    name as soon as `add_routes` adds it; any other path is "other", so that scanning clients
    cannot grow the label set without end."""

    def __init__(self, app, metrics: Metrics, router):
        self.app, self.metrics, self.router = app, metrics, router

    def route(self, scope) -> str:
        # The router's own test, without its dispatch: a request for a route with the wrong
        # method (a 405) is still that route's.
        for r in self.router.routes:
            if r.matches(scope)[0] is not Match.NONE:
                return r.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, status = self.route(scope), None

        async def counting_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            return await self.app(scope, receive, counting_send)
        except Exception:
            # Unhandled: the server's error middleware, outside this one, answers it with 500,
            # or, past the head, the connection is cut: a failure either way.
            status = 500
            raise
        finally:
            if status is not None:
                self.metrics.requests[(route, scope.get(ENDED, status))] += 1
