"""Waiting for a test's server: /health answers 200 once its model is loaded (loading runs in a
thread beside the event loop). One bounded wait for every serve test, so none can hang on a
model that never loads."""

from __future__ import annotations

import time


def ready(client, timeout: float = 30):
    """`client` once GET /health is 200; fails with /health's last answer after `timeout` s."""
    end = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < end, client.get("/health").json()
        time.sleep(0.02)
    return client
