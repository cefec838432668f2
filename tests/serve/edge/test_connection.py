"""serve/edge/connection.py's transport: a response the app gave up on (its write deadline) with
bytes unsent is aborted, so a client that stopped reading cannot keep its socket open and
counted against --max-connections; every other close flushes as before (issue 53, item 7)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from doel.serve.edge.connection import _AbortUnfinished


class Transport:
    def __init__(self, unsent: int):
        self.unsent, self.ended = unsent, None

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def close(self) -> None:
        self.ended = "closed"

    def abort(self) -> None:
        self.ended = "aborted"

    def is_closing(self) -> bool:
        return self.ended is not None


def cycle(started: bool, complete: bool) -> SimpleNamespace:
    return SimpleNamespace(response_started=started, response_complete=complete)


@pytest.mark.parametrize(
    ("the_cycle", "unsent", "ended"),
    [
        (cycle(True, False), 4096, "aborted"),  # given up on, its bytes waiting: abort
        (cycle(True, False), 0, "closed"),  # given up on, nothing waiting: an ordinary close
        (cycle(True, True), 4096, "closed"),  # complete: its last bytes are flushed
        (cycle(False, False), 4096, "closed"),  # nothing of it sent yet
        (None, 4096, "closed"),  # between requests
    ],
)
def test_a_close_aborts_only_a_response_given_up_on_with_bytes_unsent(the_cycle, unsent, ended):
    raw = Transport(unsent)
    wrapped = _AbortUnfinished(raw, SimpleNamespace(cycle=the_cycle))
    wrapped.close()
    assert raw.ended == ended
    assert wrapped.is_closing() and wrapped.get_write_buffer_size() == unsent  # the rest passes
