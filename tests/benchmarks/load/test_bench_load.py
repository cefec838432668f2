"""The load benchmark's client and bookkeeping (benchmarks/load/load_client.py, bench_load.py,
bench_load_report.py) against a fake OpenAI-compatible server: a small asyncio HTTP server that
streams server-sent events at known times. No model, no real server."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.load.bench_load import best, merged
from benchmarks.load.bench_load_inproc import ceiling, run_ceiling
from benchmarks.load.bench_load_report import CEILING, ceiling_table, targets
from benchmarks.load.load_client import bangla_chars, percentile, run_level, summarize

TOKENS = ["আমি ", "বাংলায় ", "গান ", "গাই", "।"]
FIRST_S, GAP_S = 0.06, 0.02


class FakeServer:
    """Streams TOKENS for every prompt, the first after FIRST_S, then one every GAP_S, in a
    chunked body; `usage` reports `usage_tokens` when set. A prompt containing FAIL gets a 500
    with an OpenAI error body, one containing CLOSE a stream that ends without a token."""

    def __init__(self, usage_tokens: int | None = None):
        self.usage_tokens, self.prompts, self.active, self.peak = usage_tokens, [], 0, 0

    async def handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        body = json.loads(await reader.readexactly(length))
        self.prompts.append(body["prompt"])
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.respond(body, writer)
        finally:
            self.active -= 1
            writer.close()

    async def respond(self, body, writer):
        if "FAIL" in body["prompt"]:
            err = json.dumps({"error": {"message": "no", "type": "server_error"}}).encode()
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s"
                % (len(err), err)
            )
            return
        head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
        writer.write(head.encode() + b"\r\n\r\n")

        def chunk(payload: str) -> None:
            data = payload.encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        if "CLOSE" not in body["prompt"]:
            await asyncio.sleep(FIRST_S)
            for i, t in enumerate(TOKENS):
                if i:
                    await asyncio.sleep(GAP_S)
                chunk(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n")
                await writer.drain()
            if self.usage_tokens:
                usage = {"completion_tokens": self.usage_tokens}
                usage = {
                    "choices": [],
                    "usage": usage | {"prompt_tokens_details": {"cached_tokens": 3}},
                }
                chunk(f"data: {json.dumps(usage)}\n\n")
        chunk("data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def drive(server: FakeServer, clients: int, prompts, chat: bool = False) -> dict:
    async def main():
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            return await run_level("127.0.0.1", port, clients, prompts, {"max_tokens": 5}, chat)
        finally:
            srv.close()

    return asyncio.run(main())


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)  # numpy.percentile's linear method
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


@pytest.mark.parametrize("clients", [1, 4])
def test_a_level_times_every_token_and_runs_its_clients_at_once(clients):
    server = FakeServer()
    res = drive(server, clients, [[f"p{i}a", f"p{i}b"] for i in range(clients)])
    assert res["clients"] == clients and res["requests"] == 2 * clients and res["errors"] == 0
    assert server.peak == clients  # all clients in flight together, each one request at a time
    assert sorted(server.prompts) == sorted(f"p{i}{r}" for i in range(clients) for r in "ab")
    assert res["output_tokens"] == 2 * clients * len(TOKENS)  # no usage: one token an event
    assert FIRST_S * 1000 <= res["ttft_ms_p50"] < FIRST_S * 1000 + 150
    assert GAP_S * 1000 * 0.8 <= res["tbt_ms_p50"] < GAP_S * 1000 + 100
    least = FIRST_S + GAP_S * (len(TOKENS) - 1)
    assert res["latency_ms_p50"] >= least * 1000
    assert res["wall_s"] >= 2 * least  # each client's two requests ran one after the other
    text = "".join(TOKENS)
    assert res["chars_s"] == pytest.approx(2 * clients * len(text) / res["wall_s"])
    assert res["bangla_chars_s"] == pytest.approx(2 * clients * bangla_chars(text) / res["wall_s"])


def test_usage_counts_the_tokens_when_the_server_reports_it():
    res = drive(FakeServer(usage_tokens=9), 2, [["a"], ["b"]])
    assert res["output_tokens"] == 18
    assert res["cached_prompt_tokens"] == 6  # 3 a request, as the server said
    assert res["aggregate_tok_s"] == pytest.approx(18 / res["wall_s"])


def test_errors_are_counted_and_left_out_of_the_percentiles():
    res = drive(FakeServer(), 3, [["ok"], ["FAIL"], ["CLOSE"]])
    assert res["requests"] == 3 and res["errors"] == 2
    assert any("HTTP 500" in e for e in res["error_samples"])
    assert any("no token" in e for e in res["error_samples"])
    assert res["output_tokens"] == len(TOKENS)
    assert res["ttft_ms_p95"] == res["ttft_ms_p50"]  # one good request


def test_a_connection_refused_is_an_error_not_a_crash():
    async def main():
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        return await run_level("127.0.0.1", port, 2, [["a"], ["b"]], {})

    res = asyncio.run(main())
    assert res["errors"] == 2 and res["output_tokens"] == 0 and res["ttft_ms_p50"] is None


def test_chat_turns_carry_the_conversation():
    server = FakeServer()
    res = drive(server, 1, [["Q1", "Q2", "Q3"]], chat=True)
    answer = "".join(TOKENS)
    assert server.prompts == ["Q1", "Q1" + answer + "Q2", "Q1" + answer + "Q2" + answer + "Q3"]
    assert res["requests"] == 3 and res["later_turns"]["requests"] == 2


def test_too_few_prompt_lists_for_the_clients_is_refused():
    with pytest.raises(ValueError, match="4 clients need 4 prompt lists"):
        asyncio.run(run_level("127.0.0.1", 1, 4, [["a"]], {}))


def _row(server, clients, tok_s, ttft95, mode="plain", pair="int4", process=0, **extra):
    return {
        "pair": pair,
        "server": server,
        "mode": mode,
        "prompt_tokens": 128,
        "clients": clients,
        "aggregate_tok_s": tok_s,
        "ttft_ms_p95": ttft95,
        "ttft_ms_p50": ttft95 / 2,
        "process": process,
        **extra,
    }


def test_best_keeps_each_levels_fastest_process_and_merge_replaces_levels():
    rows = [_row("doel-serve", 8, 100, 900, process=0), _row("doel-serve", 8, 120, 950, process=1)]
    rows.append(_row("llama-server", 8, 60, 800))
    (kept,) = [r for r in best(rows) if r["server"] == "doel-serve"]
    assert kept["process"] == 1
    old = {"runs": [{"n": 1}], "measurements": rows}
    new = merged(old, [_row("doel-serve", 8, 50, 10, process=7)], {"n": 2})
    assert [r["n"] for r in new["runs"]] == [1, 2]
    assert sorted(r["aggregate_tok_s"] for r in new["measurements"]) == [50, 60]
    assert merged(None, rows[:1], {"n": 3}) == {"runs": [{"n": 3}], "measurements": rows[:1]}


def test_targets_are_ratios_of_the_two_servers_with_verdicts():
    rows = [_row("doel-serve", 8, 150, 900), _row("llama-server", 8, 100, 1000)]
    rows += [_row("doel-serve", 1, 50, 100), _row("llama-server", 1, 40, 90)]
    rows += [
        _row("doel-serve", 8, 1, 1, mode="chat", later_turns={"ttft_ms_p50": 300}),
        _row("llama-server", 8, 1, 1, mode="chat", later_turns={"ttft_ms_p50": 200}),
    ]
    by = {t["target"]: t for t in targets(rows)}
    tok8 = next(t for n, t in by.items() if n.startswith("aggregate") and "8 clients" in n)
    assert tok8["value"] == pytest.approx(1.5) and tok8["met"] is True
    ttft8 = next(t for n, t in by.items() if n.startswith("p95 TTFT") and "8 clients" in n)
    assert ttft8["value"] == pytest.approx(0.9) and ttft8["met"] is True
    one = next(t for n, t in by.items() if "1 client" in n)
    assert one["value"] == pytest.approx(1.25) and one["met"] is False
    chat = next(t for n, t in by.items() if n.startswith("chat"))
    assert chat["value"] == pytest.approx(1.5) and chat["met"] is False
    missing = [t for n, t in by.items() if "16 clients" in n or "in-process" in n]
    assert missing and all(t["met"] is None and t["value"] is None for t in missing)


def test_summarize_of_nothing_is_zero_not_an_error():
    res = summarize([], 0.0)
    assert res["requests"] == 0 and res["aggregate_tok_s"] == 0.0 and res["ttft_ms_p50"] is None


def test_the_ceiling_is_prefills_and_full_steps_with_nothing_overlapping():
    # 1 client: a 0.2 s prefill and 127 steps of 10 ms give 128 tokens in 1.47 s
    assert ceiling(0.2, 0.01, 1, 128) == pytest.approx(128 / 1.47)
    # 16 clients: 16 prefills, then 127 steps of 16 rows
    assert ceiling(0.2, 0.05, 16, 128) == pytest.approx(16 * 128 / (3.2 + 6.35))
    assert ceiling(0.2, 0.05, 16, 128) > ceiling(0.2, 0.05, 8, 128)  # same step, more rows


def test_a_throughput_target_says_what_the_kernels_allow():
    rows = [_row("doel-serve", 16, 180, 900), _row("llama-server", 16, 150, 1000)]
    rows.append(_row(CEILING, 16, 210, 0, mode="ceiling", prefill_ms=220.0, step_ms=50.0))
    by = {t["target"]: t for t in targets(rows)}
    tok16 = next(t for n, t in by.items() if n.startswith("aggregate") and "16 clients" in n)
    assert tok16["met"] is False and tok16["note"] == "the engine alone: 1.40"
    ttft = next(t for n, t in by.items() if n.startswith("p95 TTFT") and "16 clients" in n)
    assert ttft["note"] == ""  # only throughput has a ceiling
    (line,) = [x for x in ceiling_table(rows) if x.startswith("| int4 |")]
    assert line == "| int4 | 128 | 16 | 220 | 50.0 | 210.0 | 180.0 (86%) | 150.0 | 1.40 |"
    assert ceiling_table(rows[:2]) == []  # not measured: no section


def test_run_ceiling_times_the_engine_alone(tiny_bundle):
    spec = {"threads": 1, "slots": 4, "new_tokens": 16, "levels": [1, 4]}
    spec["prompts"] = [[5 + i] * 12 for i in range(4)]
    one, four = run_ceiling(str(tiny_bundle), spec)
    assert (one["clients"], four["clients"]) == (1, 4)
    assert one["prefill_ms"] == four["prefill_ms"] > 0 and four["step_ms"] > 0
    assert four["aggregate_tok_s"] == pytest.approx(
        ceiling(four["prefill_ms"] / 1e3, four["step_ms"] / 1e3, 4, 16)
    )
