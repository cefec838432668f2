"""The load benchmark's client: streamed completions against any OpenAI-compatible server, timed
per token, and the figures of one level (so many clients at once) from them.

Standard library only (asyncio streams, HTTP/1.1 with chunked bodies, server-sent events), so
the same client drives doel-serve and llama-server with nothing between the socket and the
clock. Each event that carries text is one arrival: time to first token is the first such
event, time between tokens the gaps between them. A server that holds back a token (a byte
piece that ends mid-character) sends it with the next: one longer gap, counted as it is felt.
Output tokens come from the stream's `usage` (asked with stream_options.include_usage), else
llama-server's `timings.predicted_n`, else the count of events.

A level may go to /v1/chat/completions (each text a user message; a chat's turns carry the
conversation as messages) and may bound its requests on the client's side: `cut` closes a stream
after so many tokens, `wall` after so many seconds (a reply without max_tokens on random
weights runs to the end of its context). A bounded request is no error unless no token came;
its tokens are the events read (the usage comes only at a stream's end).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

BANGLA = range(0x0980, 0x0A00)


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds from its send)."""

    client: int
    turn: int = 0
    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    latency: float = 0.0
    tokens: int = 0
    text: str = ""
    counted: int | None = None  # output tokens as the server reported them
    cached: int | None = None  # prompt tokens the server took from its cache, where it says
    start: float = 0.0
    end: float = 0.0
    bounded: str | None = None  # "cut" or "wall": the client closed the stream before its end
    drafted: int = 0  # draft ids the server verified, where it says (llama-server's timings)
    accepted: int = 0  # of those, ids it kept


def bangla_chars(text: str) -> int:
    return sum(ord(c) in BANGLA for c in text)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks, as numpy's
    default; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body's pieces as they arrive: chunked transfer coding, or until the socket closes."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readline()
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


def _event(payload: dict, out: Outcome, now: float) -> None:
    """One server-sent event of a completion stream, folded into the outcome."""
    for choice in payload.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text:
            if out.ttft is None:
                out.ttft = now
            else:
                out.gaps.append(now - out.end)
            out.end = now
            out.text += text
            out.tokens += 1
    usage = payload.get("usage") or {}
    timings = payload.get("timings") or {}
    counted = usage.get("completion_tokens") or timings.get("predicted_n")
    if counted:
        out.counted = int(counted)
    # OpenAI's usage.prompt_tokens_details.cached_tokens (doel-serve), llama-server's cache_n
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    if cached is not None:
        out.cached = int(cached)
    if "draft_n" in timings:  # llama-server, drafting (--spec-type)
        out.drafted, out.accepted = int(timings["draft_n"]), int(timings["draft_n_accepted"])
    if "error" in payload:
        out.error = json.dumps(payload["error"])[:200]


async def stream(
    host: str,
    port: int,
    path: str,
    body: dict,
    out: Outcome,
    cut: int | None = None,
    wall: float | None = None,
) -> Outcome:
    """POST `body` (stream on) and time its events into `out`; errors are recorded, not raised.
    `cut`: close the stream after that many text events; `wall`: after that many seconds."""
    t0 = time.perf_counter()
    out.start = t0
    try:
        await asyncio.wait_for(_exchange(host, port, path, body, out, cut), wall)
    except asyncio.TimeoutError:
        if out.ttft is None:
            out.error = f"no token within {wall:g} s"
        else:
            out.bounded = "wall"
    out.latency = time.perf_counter() - t0
    out.tokens = out.counted or out.tokens
    return out


async def _exchange(
    host: str, port: int, path: str, body: dict, out: Outcome, cut: int | None
) -> None:
    data = json.dumps(body | {"stream": True}).encode()
    t0 = out.start
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        status, headers = await _head(reader)
        buf = b""
        async for chunk in _read_body(reader, headers):
            if status != 200:
                buf += chunk
                continue
            buf += chunk
            *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
            for ev in events:
                for line in ev.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        _event(json.loads(line[5:]), out, time.perf_counter() - t0)
                        if cut is not None and out.tokens >= cut:
                            out.bounded = "cut"
                            return
        if status != 200:
            out.error = f"HTTP {status}: {buf[:200].decode('utf-8', 'replace')}"
        elif out.ttft is None and out.error is None:
            out.error = "no token arrived"
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    """A level's figures: aggregate rates over its wall time, percentiles over its requests
    (failed ones count only as errors)."""
    ok = [o for o in outcomes if o.error is None]
    tokens = sum(o.tokens for o in ok)
    text = "".join(o.text for o in ok)
    gaps = [g for o in ok for g in o.gaps]
    ms = 1000.0

    def pct(values, q):
        v = percentile(values, q)
        return None if v is None else v * ms

    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "error_samples": sorted({o.error for o in outcomes if o.error})[:3],
        "cached_prompt_tokens": sum(o.cached or 0 for o in ok),
        "wall_s": wall,
        "output_tokens": tokens,
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "chars_s": len(text) / wall if wall > 0 else 0.0,
        "bangla_chars_s": bangla_chars(text) / wall if wall > 0 else 0.0,
        "ttft_ms_p50": pct([o.ttft for o in ok], 50),
        "ttft_ms_p95": pct([o.ttft for o in ok], 95),
        "ttft_ms_p99": pct([o.ttft for o in ok], 99),
        "tbt_ms_p50": pct(gaps, 50),
        "tbt_ms_p95": pct(gaps, 95),
        "tbt_ms_p99": pct(gaps, 99),
        "latency_ms_p50": pct([o.latency for o in ok], 50),
        "latency_ms_p95": pct([o.latency for o in ok], 95),
    }


CHAT_PATH = "/v1/chat/completions"


async def run_level(
    host: str,
    port: int,
    clients: int,
    prompts: list[list[str]],
    body: dict,
    chat: bool = False,
    *,
    path: str = "/v1/completions",
    cut: int | None = None,
    wall: float | None = None,
    outcomes: list[Outcome] | None = None,
) -> dict:
    """`clients` clients at once; client i sends the texts prompts[i] one after another, each a
    prompt of its own, or with `chat` each a turn: turn t's prompt is the previous prompt, its
    answer and the next text, so a server's prefix cache can serve all but the new text. On
    CHAT_PATH each text is a user message (a chat's turns: the messages so far, the answers as
    the assistant's). `cut`, `wall`: stream()'s bounds; `outcomes`, when given, gets every
    request's Outcome. Returns summarize() of all requests, plus that of turns 2+ in a chat."""
    if len(prompts) < clients:
        raise ValueError(f"{clients} clients need {clients} prompt lists, got {len(prompts)}")
    messages = path == CHAT_PATH

    async def client(i: int) -> list[Outcome]:
        done, history, said = [], "", []
        for turn, piece in enumerate(prompts[i]):
            history = history + piece if chat else piece
            said = (said if chat else []) + [{"role": "user", "content": piece}]
            ask = {"messages": said} if messages else {"prompt": history}
            out = Outcome(client=i, turn=turn)
            await stream(host, port, path, body | ask, out, cut, wall)
            done.append(out)
            if out.error:
                break
            history += out.text
            said = said + [{"role": "assistant", "content": out.text}]
        return done

    t0 = time.perf_counter()
    got = [o for done in await asyncio.gather(*map(client, range(clients))) for o in done]
    if outcomes is not None:
        outcomes += got
    res = summarize(got, time.perf_counter() - t0) | {"clients": clients}
    if chat:
        res["later_turns"] = summarize([o for o in got if o.turn > 0], res["wall_s"])
    return res
