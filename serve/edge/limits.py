"""Refusals the server counts and logs instead of letting them flood: `Refusals` counts each
kind into /metrics and logs at most one line per kind a minute; `QuietFloods` turns the asyncio
and uvicorn lines that repeat once per socket into such lines; `raise_open_files` raises the
soft open-file limit, as each connection holds a descriptor. The connection's own limits (read
deadline, cap, head size) are `connection.LimitedH11`'s, which reports through `Refusals`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

log = logging.getLogger("doel.serve")

LOG_EVERY = 60.0  # seconds between two log lines of one kind of refusal


class Refusals:
    """Counts refusals by kind (into `metrics.refused`) and logs at most one line per kind a
    minute, saying how many were not logged since: a flood writes a few lines, not one a socket
    (asyncio logs a whole traceback for each refused socket, so a flood over the open-file limit
    would fill the log faster than anyone can read it)."""

    def __init__(self, metrics=None, every: float = LOG_EVERY, clock=time.monotonic):
        self.metrics, self.every, self.clock = metrics, every, clock
        self.last: dict[str, float] = {}
        self.unlogged: Counter[str] = Counter()

    def __call__(self, kind: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.refused[kind] += 1
        now = self.clock()
        if kind in self.last and now - self.last[kind] < self.every:
            self.unlogged[kind] += 1
            return
        self.last[kind] = now
        more = self.unlogged.pop(kind, 0)
        log.warning("%s%s", message, f" ({more} more since the last such line)" if more else "")


class QuietFloods(logging.Filter):
    """For the asyncio and uvicorn.error loggers: messages that repeat once per socket become
    `Refusals` lines (asyncio logs a traceback for each failed accept)."""

    KINDS = {
        "socket.accept() out of system resource": "out_of_files",
        "Invalid HTTP request received.": "bad_http",  # our send_400_response logs it
        "Unsupported upgrade request.": "upgrade",
        "No supported WebSocket library detected": "upgrade",
    }

    def __init__(self, refusals: Refusals):
        super().__init__()
        self.refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        kind = next((k for m, k in self.KINDS.items() if text.startswith(m)), None)
        if kind == "out_of_files":
            exc = record.exc_info[1] if record.exc_info else None
            self.refusals(
                kind,
                f"cannot accept connections: {exc or 'out of open files'}; raise the open-file "
                "limit (ulimit -n) or lower --max-connections",
            )
        elif kind == "upgrade":
            self.refusals(kind, "refused WebSocket upgrades: this server speaks plain HTTP")
        return kind is None


def raise_open_files(resource=None) -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (each connection holds a descriptor, and
    1,024 is a common soft default); returns (before, after). No-op where there is no limit."""
    if resource is None:
        try:
            import resource
        except ImportError:  # Windows
            return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):  # e.g. macOS caps below the hard limit
        return soft, soft
    return soft, want
