"""Connection limits on a live `doel-serve` (raw sockets on loopback, a 1 s read timeout so that
it shows in seconds): a half-sent request, an idle connection or a stalled body gets a 408 and is
closed; 50 idle connections leave the server reachable, are closed on time and log one line; an
idle keep-alive connection is closed; over 256 headers is 431; connections over the limit get a
503; the soft open-file limit is raised; running out of files logs a line, not tracebacks."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import httpx2
import pytest
from live_server import live_server

resource = pytest.importorskip("resource", reason="open-file limits are POSIX")

TIMEOUT = 1  # --timeout-read and --timeout-keep-alive for these servers
SLACK = 3  # seconds on top for a busy 2-core machine; a connection never closed fails at 8 s
GET = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    args = ("--timeout-read", str(TIMEOUT), "--timeout-keep-alive", str(TIMEOUT))
    with live_server(tiny_bundle, tmp_path_factory.mktemp("limits"), *args) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=TIMEOUT + SLACK + 4)


def _until_closed(s: socket.socket) -> tuple[bytes, float]:
    """All the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _parse(data: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(x.lower().split(": ", 1) for x in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


def _metric(url: str, name: str) -> float:
    text = httpx2.get(f"{url}/metrics", trust_env=False).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, nothing sent
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # head not finished
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"prompt": ',  # body short of its length
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n\r\n"
        b'5\r\n{"pro\r\n',  # chunked body, no last chunk
    ],
    ids=["idle", "half-head", "short-body", "chunked-body"],
)
def test_a_request_not_received_in_time_gets_408_and_is_closed(server, sent):
    with _connect(server.url) as s:
        s.sendall(sent)
        data, took = _until_closed(s)
    status, headers, body = _parse(data)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["type"] == "invalid_request_error"
    assert "not received within 1 s (--timeout-read)" in body["error"]["message"]
    assert TIMEOUT - 0.1 < took < TIMEOUT + SLACK


def test_50_idle_connections_leave_it_reachable_are_closed_and_log_one_line(server):
    before = _metric(server.url, 'doel_connections_refused_total{reason="read_timeout"}')
    idle = [_connect(server.url) for _ in range(50)]
    try:
        start = time.monotonic()
        assert httpx2.get(f"{server.url}/health", trust_env=False).status_code == 200
        assert time.monotonic() - start < 0.5
        answers = [_until_closed(s) for s in idle]
    finally:
        for s in idle:
            s.close()
    assert all(_parse(data)[0] == 408 for data, _ in answers)
    assert time.monotonic() - start < TIMEOUT + SLACK
    after = _metric(server.url, 'doel_connections_refused_total{reason="read_timeout"}')
    assert after - before == 50
    log = server.log_text()
    assert log.count("closed connections: the request was not received") == 1, log[-3000:]


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(server):
    with _connect(server.url) as s:
        s.sendall(GET + b"\r\n")
        data, took = _until_closed(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"
    assert took < TIMEOUT + SLACK


def test_more_than_256_headers_is_431_and_256_pass(server):
    def with_headers(n: int) -> socket.socket:
        s = _connect(server.url)
        extra = b"".join(b"x-h%d: v\r\n" % i for i in range(n - 1))  # plus Host
        s.sendall(GET + extra + b"connection: close\r\n\r\n")
        return s

    with with_headers(256 - 1) as s:  # with connection: close, 256 in all
        assert _parse(_until_closed(s)[0])[0] == 200
    with with_headers(300) as s:
        status, _, body = _parse(_until_closed(s)[0])
    assert status == 431 and "at most 256 are accepted" in body["error"]["message"]


@pytest.fixture(scope="module")
def small(tiny_bundle, tmp_path_factory):
    """At most 4 connections, started with a soft open-file limit of 256 (hard as ours)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-file limit is {hard}")
    args = ("--max-connections", "4", "--timeout-read", str(TIMEOUT))
    with live_server(tiny_bundle, tmp_path_factory.mktemp("small"), *args, nofile=(256, hard)) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(small):
    limits = Path(f"/proc/{small.proc.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits).groups()
    assert soft == hard != "256"


def test_connections_over_the_limit_get_503_then_it_recovers(small):
    idle = [_connect(small.url) for _ in range(4)]
    answers = []
    for _ in range(10):
        with _connect(small.url) as s:
            s.sendall(GET + b"\r\n")
            answers.append(_until_closed(s)[0])
    for s in idle:
        s.close()
    status, headers, body = _parse(answers[0])
    assert {_parse(a)[0] for a in answers} == {503} and headers["retry-after"] == "1"
    assert body["error"]["type"] == "unavailable_error"
    assert "limit (--max-connections)" in body["error"]["message"]
    assert small.log_text().count("over --max-connections 4") == 1
    end = time.monotonic() + TIMEOUT + SLACK
    while httpx2.get(f"{small.url}/health", trust_env=False).status_code != 200:
        assert time.monotonic() < end, "still refusing after the idle connections closed"
        time.sleep(0.1)


def test_running_out_of_open_files_logs_one_line_not_tracebacks(tiny_bundle, tmp_path):
    # 150 connections against a limit of 128 files: accepting fails until some are closed.
    with live_server(tiny_bundle, tmp_path, "--timeout-read", str(TIMEOUT), nofile=(128, 128)) as s:
        flood = [_connect(s.url) for _ in range(150)]
        time.sleep(1.5)
        for c in flood:
            c.close()
        end = time.monotonic() + SLACK + 2
        while True:
            try:
                if httpx2.get(f"{s.url}/health", trust_env=False, timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < end, "not reachable after the flood"
        log = s.log_text()
    assert "Traceback" not in log and len(log) < 20_000, log[-3000:]
    assert log.count("cannot accept connections: [Errno 24]") == 1, log[-3000:]
    assert "--max-connections lowered from 512 to 64" in log


def _head(size: int) -> bytes:
    """A GET whose head (line, headers, blank line) is `size` bytes, in headers of 1,000."""
    start = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    fill, n = size - len(start) - 2, 0
    lines = []
    while fill > 0:
        value = b"x" * max(min(1000, fill) - len(b"x-%d: \r\n" % n), 1)
        lines.append(b"x-%d: %s\r\n" % (n, value))
        fill -= len(lines[-1])
        n += 1
    return start + b"".join(lines) + b"\r\n"


@pytest.mark.parametrize("size", [16 * 1024 + 1, 20_000, 70_000])
@pytest.mark.parametrize("pieces", [1, 7])
def test_a_head_over_16_kib_is_400_however_it_arrives(server, size, pieces):
    head = _head(size)
    assert len(head) == size
    with _connect(server.url) as s:
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            try:
                s.sendall(head[i : i + step])
            except (BrokenPipeError, ConnectionResetError):
                break  # refused before the last piece: the answer is already there to read
            time.sleep(0.01 if pieces > 1 else 0)
        status, _, body = _parse(_until_closed(s)[0])
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "16 KiB" in body["error"]["message"]


def test_a_head_of_16_kib_is_answered_and_pipelined_heads_are_measured(server):
    with _connect(server.url) as s:
        s.sendall(_head(16 * 1024))
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    # Pipelined: the second head, over the limit, arrives in the same write as the first.
    with _connect(server.url) as s:
        s.sendall(_head(200) + _head(30_000))
        data = _until_closed(s)[0]
    assert data.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 400" in data
