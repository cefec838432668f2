"""A real `doel-serve` process for the live tests (the openai client, the load test, the browser).

It binds a free loopback port, and a port taken between choosing and binding (another test
process got it first) is retried on a new one. `/health` is polled until 200, with a deadline,
and the server's own log shown if it dies or never gets there. On the way out it gets SIGINT,
then SIGKILL if it lingers; and on Linux the kernel kills it should pytest itself be killed
(PR_SET_PDEATHSIG), so no run leaves a server behind. Its memory is read with
doel.contracts.memory: `pss_kib`, what the system pays for it, and `rss_kib`, its resident memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from doel.contracts import memory

ROOT = Path(__file__).resolve().parents[1]
PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path  # the server's stdout and stderr

    def memory(self) -> memory.Memory:
        """The server process's memory (doel.contracts.memory); fails once it is gone."""
        got = memory.measure(self.proc.pid)
        assert got.rss_bytes > 0, f"no memory figures for pid {self.proc.pid}"
        return got

    def pss_kib(self) -> int:
        """What the system pays for the server process (its Pss), in KiB."""
        return self.memory().pss_bytes // 1024

    def rss_kib(self) -> int:
        """The server process's resident memory, in KiB: it misses pages a shared anonymous
        mapping keeps after giving them back, so judge memory by `pss_kib`."""
        return self.memory().rss_bytes // 1024

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _child_setup(nofile: tuple[int, int] | None):
    def setup() -> None:
        _die_with_parent()
        if nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    return setup


def _healthy(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    """True once /health is 200; False if the process exits first; fails at the deadline."""
    end = time.monotonic() + timeout
    with httpx2.Client(trust_env=False, timeout=5) as client:  # no proxy for loopback
        while proc.poll() is None:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return True
            except httpx2.TransportError:
                pass  # not listening yet
            if time.monotonic() > end:
                pytest.fail(f"doel-serve was not healthy within {timeout:.0f} s")
            time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown (lifespan end included)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def live_server(
    bundle: Path,
    log_dir: Path,
    *args: str,
    timeout: float = 60,
    tries: int = 3,
    nofile: tuple[int, int] | None = None,
) -> Iterator[LiveServer]:
    """`python -m doel.serve BUNDLE --port P --threads 1 ARGS...`, healthy, stopped on exit;
    `nofile`: the server's open-file limit (soft, hard) as it starts."""
    env = {k: v for k, v in os.environ.items() if k != "DOEL_API_KEY"}
    for attempt in range(1, tries + 1):
        port = free_port()
        log = log_dir / f"serve-{port}.log"
        cmd = [
            sys.executable,
            "-m",
            "doel.serve",
            str(bundle),
            "--port",
            str(port),
            "--threads",
            "1",
        ]
        cmd += ["--log-level", "warning", *args]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup(nofile),
            )
        url = f"http://127.0.0.1:{port}"
        try:
            if _healthy(proc, url, timeout):
                yield LiveServer(proc, url, log)
                return
        finally:
            _stop(proc)
        text = log.read_text(encoding="utf-8", errors="replace")
        # doel-serve's own line ("port N on 127.0.0.1 is in use"), or uvicorn's if the port
        # was taken between doel-serve's check and uvicorn's bind ("address already in use")
        if " in use" not in text.lower() or attempt == tries:
            pytest.fail(f"doel-serve exited with {proc.returncode}:\n{text[-3000:]}")
