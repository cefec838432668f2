"""A live `doel-serve` on loopback under the abuse of issue 15, bounded in count and time: stop
strings at their cap over long completions, refusals kept short, clients that leave, text that is
not Unicode. The model is the tiny random one with 4,096 positions, so that one greedy request
can run for seconds (about 2,000 tokens a second here)."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx2
import pytest
from live_server import live_server

pytestmark = pytest.mark.slow

CONTEXT = 4096
MB = 1 << 20  # the server's default body limit
ROOT = Path(__file__).resolve().parents[3]
PROMPT = "নদীর ধারে একটি ছোট গ্রাম"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tokenizer_path, tiny_model_config):
    pytest.importorskip("onnxruntime_genai")
    torch = pytest.importorskip("torch")
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.hf import save_model
    from doel.train.model import Llama

    # The tiny bundle's model with a long context (conftest).
    cfg = dataclasses.replace(tiny_model_config, max_position_embeddings=CONTEXT)
    root = tmp_path_factory.mktemp("abuse")
    torch.manual_seed(0)
    ckpt = save_model(Llama(cfg), root / "ckpt", tokenizer=tokenizer_path)
    out = root / "long"
    export_checkpoint(ckpt, out, ExportOptions(quant="fp32", eval_tokens=64, log=lambda _m: None))
    return out


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    args = ("--slots", "2", "--max-queue", "2")
    with live_server(bundle, tmp_path_factory.mktemp("log"), *args) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


@pytest.fixture(scope="module")
def http(server):
    with httpx2.Client(base_url=server.url, trust_env=False, timeout=60) as c:
        yield c


def metric(http: httpx2.Client, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_stop_strings_at_the_cap_over_2000_tokens_and_one_over_it(http):
    """Four 256-character stops that never match leave a 2,000-token completion as it is;
    one of 257 characters is refused by name before any work."""
    req = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0}
    plain = http.post("/v1/completions", json=req).json()
    assert plain["usage"]["completion_tokens"] == 2000
    text = plain["choices"][0]["text"]
    stops = [text[k : k + 255] + "\x00" for k in (0, 100, 500, 1000)]
    stopped = http.post("/v1/completions", json={**req, "stop": stops}).json()
    assert stopped["choices"] == plain["choices"]
    r = http.post("/v1/completions", json={**req, "stop": [*stops[:3], "x" * 257]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stop"
    assert err["message"] == (
        "stop: a stop string is 257 characters, over the limit of 256; shorten it"
    )


def _bad_bodies() -> dict[str, tuple[str, bytes]]:
    """1 MB requests: many invalid items, many unknown fields, a text prompt far over the
    context, too many token ids; and one that is served, a 1 MB text to tokenize."""
    bn = (ROOT / "train" / "sample" / "bn.txt").read_text(encoding="utf-8")
    text = (bn * (MB // len(bn))).encode()[: MB - 20_000].decode(errors="ignore")
    fields = ",".join(f'"junk{i}": 0' for i in range(70_000))

    def utf8(obj) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode()

    return {
        "invalid items": ("/v1/completions", b'{"prompt": [' + b'"a",' * 249_999 + b'"a"]}'),
        "unknown fields": ("/v1/completions", b'{"prompt": "x", ' + fields.encode() + b"}"),
        "text over the context": ("/v1/completions", utf8({"prompt": text})),
        "ids over the context": ("/detokenize", b'{"tokens": [' + b"-1," * 330_000 + b"1]}"),
        "text to tokenize": ("/tokenize", utf8({"prompt": text})),
    }


def _health_polls(url: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    with httpx2.Client(base_url=url, trust_env=False, timeout=10) as c:
        while not stop.is_set():
            t = time.perf_counter()
            assert c.get("/health").status_code == 200
            out.append((t, time.perf_counter()))
            time.sleep(0.002)


@pytest.mark.parametrize("kind", list(_bad_bodies()))
def test_health_answers_within_100_ms_while_a_1_mb_request_is_refused(server, http, kind):
    """Issue 15: a 250,000-item body took 5.9 s to refuse (24 MB of errors), a 1 MB prompt was
    tokenized for seconds before being refused, and every stream froze meanwhile. The refusal
    is now short and quick, and the event loop stays free: /health, asked every 2 ms while the
    request is in flight, answers each time within 100 ms."""
    path, body = _bad_bodies()[kind]
    assert MB * 0.9 < len(body) <= MB
    polls, stop = [], threading.Event()
    poller = threading.Thread(target=_health_polls, args=(server.url, stop, polls))
    poller.start()
    time.sleep(0.02)
    sent = time.perf_counter()
    try:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    finally:
        answered = time.perf_counter()
        stop.set()
        poller.join()
    # Polls in flight while the request was. There may be none when it was quick, and then
    # it was answered within 100 ms, which bounds how long it can have held the loop.
    during = [end - start for start, end in polls if end > sent and start < answered]
    assert during or answered - sent < 0.1, answered - sent
    assert max(during, default=0.0) < 0.1, (answered - sent, sorted(during)[-5:])
    if kind == "text to tokenize":
        assert r.status_code == 200 and r.json()["count"] > 100_000
    else:
        assert r.status_code == 400 and len(r.content) < 2000, r.content[:2000]
        assert r.json()["error"]["message"]


def _open(server, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A completion request sent on a raw socket, its answer left unread: a client that can
    leave at a moment the test chooses."""
    port = int(server.url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(head.encode() + data)
    return s


def _until(http: httpx2.Client, running: int, waiting: int, timeout: float) -> float:
    """Seconds until /metrics shows these gauges; fails after `timeout`."""
    start = time.perf_counter()
    while True:
        now = (metric(http, "doel_requests_running"), metric(http, "doel_queue_depth"))
        elapsed = time.perf_counter() - start
        if now == (running, waiting):
            return elapsed
        assert elapsed < timeout, f"running, waiting = {now} after {elapsed:.2f} s"
        time.sleep(0.01)


LONG = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0}  # about 2 s alone


def _leave_and_check_nothing_runs(http, socks, made: float) -> None:
    """Two of `socks` running and two queued, their clients close them: the slots and the
    queue are empty within 0.5 s, no token is made after, and fewer than 4,000 were made (the
    running two were cut short, the queued two never began)."""
    try:
        _until(http, running=2, waiting=2, timeout=10)
    finally:
        for s in socks:
            s.close()
    assert _until(http, running=0, waiting=0, timeout=0.5) < 0.5
    after = metric(http, "doel_generation_tokens_total")
    time.sleep(0.5)
    assert metric(http, "doel_generation_tokens_total") == after
    assert after - made < 4000


def test_requests_whose_clients_left_free_their_slots_at_once(server, http):
    """Issue 15: a non-streamed request ran to max_tokens after its client left. Two running
    and two queued (2 slots, a queue of 2), 4,000 tokens each: once the clients close their
    sockets the slots and the queue are empty within 0.5 s, and no token is made after."""
    gone = 'doel_requests_total{route="/v1/completions",status="499"}'
    made, left = metric(http, "doel_generation_tokens_total"), metric(http, gone)
    _leave_and_check_nothing_runs(http, [_open(server, LONG) for _ in range(4)], made)
    assert metric(http, gone) - left == 4  # counted as "client closed request"


def test_chat_clients_that_leave_free_their_slots_at_once(server, http):
    """The same for chat, streamed and not: two running, two queued; the clients close their
    sockets and the slots and the queue are empty within 0.5 s, and no token is made after."""
    route = "/v1/chat/completions"
    gone = f'doel_requests_total{{route="{route}",status="499"}}'
    made, left = metric(http, "doel_generation_tokens_total"), metric(http, gone)
    # Greedy, as LONG: sampled at temperature 1, the random model draws <|end|> or <|eos|> within
    # a few hundred tokens, and a request that ends by itself proves nothing about leaving.
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4000, "temperature": 0}
    socks = [_open(server, body | {"stream": i >= 2}, route) for i in range(4)]
    _leave_and_check_nothing_runs(http, socks, made)
    assert metric(http, gone) - left >= 2  # the whole ones that left (a stream began as 200)


def test_a_batch_takes_its_slots_only_and_frees_them_when_its_client_leaves(server, http):
    """Four prompts in one request, 2 slots and a queue of 2: two run, the other two wait
    inside the request rather than filling the queue (a newcomer still gets in), and when the
    client leaves all stop at once."""
    made = metric(http, "doel_generation_tokens_total")
    batch = _open(server, {**LONG, "prompt": [PROMPT, "নদী", "a river", PROMPT]})
    try:
        _until(http, running=2, waiting=0, timeout=10)
        newcomer = _open(server, {"prompt": PROMPT, "max_tokens": 3})
        _until(http, running=2, waiting=1, timeout=5)
        newcomer.close()
    finally:
        batch.close()
    assert _until(http, running=0, waiting=0, timeout=0.5) < 0.5
    after = metric(http, "doel_generation_tokens_total")
    time.sleep(0.5)
    assert metric(http, "doel_generation_tokens_total") == after
    assert after - made < 2 * 4000


def test_a_queued_stream_whose_client_left_is_dropped_before_its_prompt_is_read(server, http):
    """Issue 15: queued streaming requests whose clients had left still had their prompts
    prefilled, holding the queue full (others got 429). With both slots busy, two streams
    queue; their clients leave; the queue empties at once though the slots stay busy, and a
    newcomer is queued rather than refused, then served."""
    runners = [_open(server, LONG) for _ in range(2)]
    try:
        _until(http, running=2, waiting=0, timeout=10)
        streams = [_open(server, {**LONG, "stream": True}) for _ in range(2)]
        _until(http, running=2, waiting=2, timeout=10)
        for s in streams:
            s.close()
        assert _until(http, running=2, waiting=0, timeout=0.5) < 0.5
        newcomer = _open(server, {"prompt": PROMPT, "max_tokens": 3, "stream": True})
        _until(http, running=2, waiting=1, timeout=5)
    finally:
        for s in runners:
            s.close()
    with newcomer:
        newcomer.settimeout(10)
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
            chunk = newcomer.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in answer
    _until(http, running=0, waiting=0, timeout=1.0)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 3}', "prompt"),
        ("/v1/completions", rb'{"prompt": "ab", "stream": true, "stop": "\udfff"}', "stop"),
        ("/v1/completions", rb'{"prompt": "ab", "stop": ["x", "a\ud800b"]}', "stop"),
        ("/tokenize", rb'{"prompt": "a\ud800b"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_not_a_500(http, path, body, param):
    """Issue 15: JSON's "\\ud800" escape without its pair parses into a lone surrogate, which
    is not Unicode text; the tokenizer failed on it with a 500 (plain text, a traceback)."""
    before = _count_5xx(http, path)
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, r.text
    assert err["type"] == "invalid_request_error" and "lone surrogate" in err["message"]
    assert _count_5xx(http, path) == before == 0


def _count_5xx(http: httpx2.Client, path: str) -> int:
    text = http.get("/metrics").text
    found = re.findall(
        rf'^doel_requests_total\{{route="{path}",status="5\d\d"\}} (\d+)$', text, re.M
    )
    return sum(map(int, found))
