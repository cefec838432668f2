"""Completions: text in, text out, between the HTTP routes and the token-id engine.

Requests go to the `Scheduler`, which batches the decode steps of all running
sequences; a request beyond `max_queue` waiting is refused with 429 instead of queueing without
end, and a request whose client disconnects (its generator closed: the app watches the
connection, queued or running, streamed or not) frees its place at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tokenizers import Tokenizer, normalizers

from doel.contracts import memory, untrusted
from doel.contracts.decoding import CONTEXT_IDS
from doel.serve.core.engine import BundleError, Engine, read_bundle
from doel.serve.core.grammar_limits import compiled, uncounted
from doel.serve.core.logprobs import Record, openai_logprobs
from doel.serve.core.prefix import Hit
from doel.serve.core.sampling import SamplingParams
from doel.serve.core.scheduler import QueueFull, Scheduler
from doel.serve.core.structured import Format, Grammars
from doel.serve.core.template import ChatTemplate
from doel.serve.core.textstream import TextStream
from doel.serve.edge.metrics import Metrics
from doel.serve.edge.refusal import RequestError
from doel.serve.edge.tenants import ONE
from doel.serve.endpoints.protocol import CompletionRequest
from doel.serve.settings import Settings

# Tokenizing runs here, off the event loop: a long text takes seconds. The batch calls let go
# of the GIL as they work (`encode` held it throughout, blocking the loop as much as if it ran
# there). Two at a time, so long texts cannot take every core from the engine.
TOKENIZER_THREADS = ThreadPoolExecutor(2, thread_name_prefix="doel-tokenizer")
# Characters NFC can fold into one: a character's canonical decomposition has at most 4.
NFC_FOLD = 4
# The part of the memory available at load that a model's default KV pool may take (vLLM takes
# 0.9 of a GPU's by default; here the weights, the tokenizer, grammars and other processes share
# the machine's RAM, so half). --kv-positions sets the pool outright.
POOL_MEMORY_SHARE = 0.5
ECHO_WITH_FORMAT = (
    "echo cannot be combined with response_format: the prompt in front would make the text "
    "no document of the schema; unset echo"
)
STOP_WITH_FORMAT = (
    "stop strings cannot be combined with response_format: a stop would cut the document "
    "where it does not parse; unset stop (the output ends where the schema's document ends)"
)


def available_memory() -> int | None:
    """Bytes the system can give without swapping, else its physical memory, else None."""
    return memory.available_bytes() or untrusted.memory_bytes()


def pool_positions(engine: Engine, asked: int, models: int = 1) -> int:
    """The KV pool of a model just loaded: `asked` (--kv-positions), or by default every slot's
    whole context as far as POOL_MEMORY_SHARE of the memory available, shared by the `models`
    that may be loaded, allows (at least one whole context, which the bundle check fits in
    memory). A pool asked for past the available memory is a BundleError naming the flag: the
    process would be killed under load instead of making requests wait."""
    whole = engine.slots * engine.context_length
    per_position = sum(a.nbytes for a in engine.kv_arrays) // whole
    free = available_memory()
    if asked:
        if free is not None and min(asked, whole) * per_position > free:
            most = free // per_position
            raise BundleError(
                f"--kv-positions {asked} needs {min(asked, whole) * per_position / 2**30:.1f} GiB "
                f"of KV cache, more than the {free / 2**30:.1f} GiB this machine has available; "
                f"ask for at most {most}"
            )
        return asked
    if free is None:
        return whole
    share = int(POOL_MEMORY_SHARE * free / max(models, 1)) // per_position
    return min(whole, max(engine.context_length, share))


@dataclass
class Piece:
    """One step of a completion: new text (maybe empty), and at the end why it ended."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ids: list[int] | None = None  # at the end of a scored one: prompt + completion ids
    cached_tokens: int = 0  # prompt tokens that a slot's cache held
    stop: str | None = None  # the stop string that ended it (Anthropic's stop_sequence)


class Service:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        name: str,
        max_queue: int = Settings.max_queue,
        **pool,  # kv_positions, step_tokens, prefix_keep, draft_tokens: the Scheduler's
    ):
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.scheduler = Scheduler(engine, max_queue, **pool)
        self.metrics = Metrics()  # the app puts its own here, shared with its middleware
        self.chat: ChatTemplate | None = None  # the bundle's, if its tokenizer has one
        # No token covers more characters than the longest vocabulary entry (byte tokens and
        # byte-level entries cover fewer), which bounds a text's token count from below.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        bundle: str,
        threads: int = Settings.threads,
        name: str | None = None,
        max_queue: int = Settings.max_queue,
        slots: int = Settings.slots,
        models: int = 1,  # models that may be loaded beside it: they share the memory
        **pool,  # kv_positions, step_tokens, prefix_keep, draft_tokens: the Scheduler's
    ):
        b = read_bundle(bundle)
        tok = Tokenizer.from_file(str(b.tokenizer))
        engine = Engine(b, threads, slots if b.share_buffer else 1)
        engine.warm_up()
        pool["kv_positions"] = pool_positions(engine, pool.get("kv_positions", 0), models)
        svc = cls(engine, tok, name or b.folder.resolve().name, max_queue, **pool)
        svc.chat = ChatTemplate.load(b.folder)
        return svc

    @property
    def grammars(self) -> Grammars:
        """The structured-output compilers of this model's tokenizer, built on first use (it
        takes a while for a large vocabulary): call off the event loop (a compile thread).
        Building them, or waiting for another thread to, is `uncounted`: the server's cost,
        once, not the time of the schema whose compile asked first (--compile-timeout)."""
        if self._grammars is not None:
            return self._grammars
        with uncounted(), self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(
                    self.tokenizer.to_str(), self.vocab_size, self.engine.bundle.eos_id
                )
            return self._grammars

    def compile_format(self, rf: dict | None, param: str = "response_format") -> Format | None:
        """`response_format` as a Format (None: plain text), or a 400 naming what the engine
        cannot enforce; cached per schema. Call through `compiled` (a compile thread)."""
        return None if rf is None else self.grammars.response_format(rf, param)

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def vocab_size(self) -> int:
        return self.engine.bundle.vocab_size

    async def in_thread(self, fn, *args):
        """`fn(*args)` on a tokenizer thread: tokenizing and detokenizing go through here."""
        return await asyncio.get_running_loop().run_in_executor(TOKENIZER_THREADS, fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        batch = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def least_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without reading it: a token covers at most
        `max_token_chars` normalized characters, and NFC (doel's normalizer) folds at most
        NFC_FOLD characters into one. 0 under another normalizer."""
        norm = self.tokenizer.normalizer
        if norm is None:
            fold = 1
        elif isinstance(norm, normalizers.NFC):
            fold = NFC_FOLD
        else:
            return 0
        return -(-len(text) // (fold * self.max_token_chars))

    def decode(self, ids: list[int]) -> str:
        self.check_ids(ids, "tokens")
        return self.tokenizer.decode_batch([ids], skip_special_tokens=True)[0]

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(
                400,
                f"token id {bad[0]} is outside the vocabulary (0 to {self.vocab_size - 1})",
                param,
            )

    def prompt_ids(
        self, req: CompletionRequest, prompt: str | list[int] | None = None
    ) -> list[int]:
        """The ids of `prompt` (default: the request's only one), checked against the
        vocabulary and the context length."""
        ctx = self.context_length
        prompt = req.prompts()[0] if prompt is None else prompt
        if isinstance(prompt, str):
            least = self.least_tokens(prompt)
            if least >= ctx:  # refused before the costly part, encoding
                raise RequestError(
                    400,
                    f"the prompt ({len(prompt):,} characters) is at least {least:,} tokens, "
                    f"but the model's context is {ctx} tokens; shorten the prompt",
                    "prompt",
                )
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
            if not ids:
                raise RequestError(400, "the prompt has no tokens", "prompt")
            self.check_ids(ids, "prompt")
        self.check_fits(len(ids), req.max_tokens)
        return ids

    def room(self) -> int:
        """Positions one sequence may hold: the model's context, or a smaller KV pool."""
        return min(self.context_length, self.scheduler.kv_positions)

    def room_is(self) -> str:
        """What bounds `room`, in words for a refusal."""
        if self.scheduler.kv_positions < self.context_length:
            pool = self.scheduler.kv_positions
            return f"this server's KV cache of {pool} positions (--kv-positions)"
        return f"the model's context of {self.context_length} tokens"

    def check_fits(
        self, n: int, max_tokens: int, prompt: str = "prompt", param: str = "prompt"
    ) -> None:
        """A prompt of `n` tokens and `max_tokens` more fit the context and the KV pool, or a
        400 saying so."""
        ctx = self.context_length
        pool = self.scheduler.kv_positions
        if n + max_tokens > pool and pool < ctx:
            raise RequestError(
                400,
                f"the {prompt} is {n} tokens and max_tokens is {max_tokens}: {n + max_tokens}"
                f" positions, but this server's KV cache holds {pool} (--kv-positions); shorten "
                f"the {prompt} or ask for at most {max(pool - n, 0)} tokens",
                "max_tokens" if n < pool else param,
            )
        if n + max_tokens > ctx:
            raise RequestError(
                400,
                f"the {prompt} is {n} tokens and max_tokens is {max_tokens}: {n + max_tokens}"
                f" tokens, but the model's context is {ctx} tokens; shorten the {prompt} or ask "
                f"for at most {max(ctx - n, 0)} tokens",
                "max_tokens" if n < ctx else param,
            )

    async def complete(
        self,
        req: CompletionRequest,
        prompt: str | list[int] | None = None,
        record: Record | None = None,
        fmt: Format | None = None,
    ) -> AsyncIterator[Piece]:
        """Pieces of text as they become safe to send; the last one carries the finish reason
        and the token counts (and with `record`, which the scheduler fills with
        log-probabilities, the ids). `fmt`: the output's grammar (default: the request's
        response_format's). Raises RequestError before the first piece."""
        spec = req.format_spec()
        if fmt is None and spec is not None:
            # bounded in time as the routes' compiles are (a caller may leave fmt to us)
            fmt = await compiled("response_format", self.compile_format, spec)
        if fmt is not None and req.echo:
            raise RequestError(400, ECHO_WITH_FORMAT, "echo")
        ids = await self.in_thread(self.prompt_ids, req, prompt)
        eos = self.engine.bundle.eos_id
        params = req.to_sampling_params(req.max_tokens, () if eos is None else (eos,))
        # Closed with this generator (a client gone), not left to the garbage collector.
        run = self.run(ids, params, req.stops(), record, req.cache, fmt)
        async with contextlib.aclosing(run) as pieces:
            async for piece in pieces:
                yield piece

    async def run(
        self,
        ids: list[int],
        params: SamplingParams,
        stops: list[str],
        record: Record | None = None,
        cache: Hashable | None = ONE,
        fmt: Format | None = None,
    ) -> AsyncIterator[Piece]:
        """`complete` from the prompt's ids on (chat comes in here with its rendered ids);
        `cache`: the prefix cache's partition (`tenants.partition`); `fmt`: the grammar the
        output must follow, whose last piece says "stop" only when the
        grammar accepted the whole text."""
        if fmt is not None and stops:
            raise RequestError(400, STOP_WITH_FORMAT, "stop")
        stream = TextStream(self.tokenizer.decode, stops, ids[-CONTEXT_IDS:])
        made, t0, ttft, out, hit = 0, time.perf_counter(), 0.0, list(ids), Hit()
        constraint = None if fmt is None else fmt.start()
        try:
            generating = self.scheduler.generate(ids, params, record, hit, cache, constraint)
            async with contextlib.aclosing(generating) as tokens:
                async for token in tokens:
                    out.append(token)
                    made += 1
                    if made == 1:
                        ttft = time.perf_counter() - t0
                        self.metrics.ttft.observe(ttft)
                    text = stream.push(token)
                    if text:
                        yield Piece(text)
                    if stream.stopped:
                        break  # closing the generator frees the slot
        except QueueFull:
            waiting = len(self.scheduler.waiting)
            raise RequestError(
                429, f"{waiting} requests are waiting; retry shortly", kind="rate_limit_exceeded"
            ) from None
        finally:
            self.metrics.completion(len(ids), made, ttft, time.perf_counter() - t0, hit.tokens)
        full = made >= params.max_tokens or len(ids) + made >= self.context_length
        reason = "stop" if stream.stopped or not full else "length"
        if constraint is not None:  # fails closed: only a document the grammar accepted
            reason = "stop" if constraint.finished else "length"
        ids_out = out if record else None
        rest = stream.finish()
        yield Piece(rest, reason, len(ids), made, ids_out, hit.tokens, stream.stop)

    def logprobs(self, ids: list[int], prompt_tokens: int, record: Record, echo: bool) -> dict:
        """`choices[i].logprobs` of prompt + completion `ids`, the prompt's tokens included
        with `echo` (run it on a tokenizer thread). Text offsets are into the choice's text."""
        entries = record.entries if record.prompt else [None] * prompt_tokens + record.entries
        # A stop string can end the text before the last ids the scheduler scored.
        start = 0 if echo else prompt_tokens
        return openai_logprobs(self.tokenizer, ids, entries[: len(ids)], start)
