"""bench_core's client bounds (load_client's `cut`, `wall` and chat route) against a fake
streaming server, and its bookkeeping (streaming_at_once, best, markdown, code_of). No model,
no real server."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from benchmarks.load.bench_core import best, code_of, markdown, streaming_at_once
from benchmarks.load.load_client import CHAT_PATH, Outcome, run_level

GAP_S = 0.01


class Endless:
    """Streams "x " every GAP_S until the client goes (a reply without max_tokens on random
    weights); a request whose text holds SLOW gets its first token after 5 s."""

    def __init__(self):
        self.bodies, self.paths, self.gone = [], [], 0

    async def handle(self, reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        self.paths.append(head.split()[1])
        length = int(head.lower().split("content-length:")[1].split()[0])
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            if "SLOW" in json.dumps(body):
                await asyncio.sleep(5)
            for _ in range(10_000):
                data = b"data: " + json.dumps({"choices": [{"delta": {"content": "x "}}]}).encode()
                writer.write(b"%x\r\n%s\n\n\r\n" % (len(data) + 2, data))
                await writer.drain()
                await asyncio.sleep(GAP_S)
        except (ConnectionError, OSError):
            self.gone += 1
        finally:
            writer.close()


def drive(server, prompts, **kw) -> tuple[dict, list[Outcome]]:
    async def main():
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port, outcomes = srv.sockets[0].getsockname()[1], []
        try:
            got = await run_level("127.0.0.1", port, len(prompts), prompts, {}, outcomes=outcomes,
                                  **kw)  # fmt: skip
            await asyncio.sleep(0.2)  # the server's writes to a closed socket fail
            return got, outcomes
        finally:
            srv.close()

    return asyncio.run(main())


def test_a_cut_closes_the_stream_after_so_many_tokens_and_is_no_error():
    server = Endless()
    res, outcomes = drive(server, [["a"], ["b"]], cut=5)
    assert res["errors"] == 0 and res["output_tokens"] == 10
    assert [o.bounded for o in outcomes] == ["cut", "cut"]
    assert server.gone == 2  # the server saw both clients go
    assert streaming_at_once(outcomes) == 2


def test_the_wall_bounds_a_request_an_error_only_without_a_token():
    res, outcomes = drive(Endless(), [["a"], ["SLOW"]], wall=0.3)
    assert res["errors"] == 1 and "no token within 0.3 s" in res["error_samples"][0]
    assert {o.bounded for o in outcomes} == {"wall", None}
    assert res["output_tokens"] > 5


def test_chats_send_messages_and_carry_the_conversation():
    server = Endless()
    drive(server, [["Q1", "Q2"]], chat=True, path=CHAT_PATH, cut=2)
    assert server.paths == [CHAT_PATH, CHAT_PATH]
    assert server.bodies[1]["messages"] == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "x x "},
        {"role": "user", "content": "Q2"},
    ]
    assert "prompt" not in server.bodies[0] and "max_tokens" not in server.bodies[0]


def test_streaming_at_once_counts_overlapping_replies():
    def o(start, ttft, end):
        return Outcome(client=0, start=start, ttft=ttft, end=end)

    # 0: 1-3, 1: 2-4, 2: 3.5-5 (after 0 ended), 3: no token
    got = [o(0, 1, 3), o(1, 1, 3), o(3, 0.5, 2), Outcome(client=3)]
    assert streaming_at_once(got) == 2


def _row(code, level, clients, tok_s, process=0):
    pct = {f"{w}_ms_p{q}": 10.0 * q for w in ("ttft", "tbt") for q in (50, 95, 99)}
    return {"code": code, "level": level, "clients": clients, "aggregate_tok_s": tok_s,
            "process": process, "running_max": 4 if code == "before" else 16,
            "running_mean": 4.0, "waiting_max": 12, "streaming_max": 4, "requests": 32,
            "errors": 1, "http_400": 0, "http_429": 1, "load_1min": 1.0} | pct  # fmt: skip


def test_best_keeps_each_levels_fastest_process_and_the_report_compares_them():
    rows = [_row(c, lv, n, t, p) for p, t in ((0, 100.0), (1, 90.0)) for c in ("before", "after")
            for lv, n in (("chat", 16), ("plain", 8), ("plain", 16))]  # fmt: skip
    rows += [_row("after", "chat", 16, 200.0, 2)]
    kept = best(rows)
    assert len(kept) == 6 and all(r["process"] == 0 for r in kept if r["code"] == "before")
    run = {"model": "m", "before": {"rev": "b", "serve": "x"}, "after": {"rev": "a", "serve": "y"},
           "processes": 2, "argv": [], "kv_positions": 8192, "chat_rounds": 2, "cut": 256,
           "wall": 300.0, "rounds": 2}  # fmt: skip
    cpu = {"class": "c", "isa": {"AVX2": True}}
    text = markdown({"date": "d", "machine": "m", "cpu": cpu, "run": run, "best": kept})
    assert "| chats: tok/s | 2.00 |" in text and "| chats: most running at once | 4.00 |" in text
    assert "| 16 clients: p99 time between tokens | 1.00 |" in text
    assert "| before | 4 / 4.0 | 4 | 12 | 100.0 | 500 / 950 / 990 |" in text


def test_code_of_points_started_processes_at_a_tree_and_restores_the_environment(monkeypatch):
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    with code_of(Path("/tmp/tree")):
        assert os.environ["PYTHONPATH"] == "/tmp/tree" and os.environ["PYTHONSAFEPATH"] == "1"
    assert os.environ["PYTHONPATH"] == "/somewhere" and "PYTHONSAFEPATH" not in os.environ
