"""Structured output: a JSON schema (or a grammar) enforced by constrained decoding, failing closed.

The API, for the routes (response_format, tools, /v1/responses):

- `Grammars(tokenizer_json, vocab_size, eos_id)`: one per served model (a Service has one,
  `svc.grammars`, built on first use). Its compilers return a `Format`, cached per schema text
  (the same schema compiles once; at most CACHE_SIZE of them and CACHE_BYTES, estimated), or
  raise `RequestError(400, message naming the unsupported keyword or the limit, param)`:
  - `response_format(rf, param)`: OpenAI's `response_format` dict, `{"type": "text"}` (None:
    no format), `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}`, or the Responses API's flat `{"type": "json_schema", "name",
    "schema", "strict"}` (its `text.format`);
  - `json_schema(schema, param)`: a bare JSON schema (a dict, or true for any JSON value);
  - `lark(grammar, param)`: a grammar in llguidance's Lark dialect (a JSON schema inside it is
    `%json { ... }`), for shapes a schema cannot say (a tool call's wrapper).
  Compiling can take milliseconds (a large schema, a hundred): call them through
  `compiled(param, compiler, ...)`, off the event loop and bounded in time (--compile-timeout,
  which counts the compile's own work: not its wait for a thread, nor the first-use build of
  `svc.grammars`, which is `grammar_limits.uncounted`).
- `Service.run(ids, params, stops, ..., fmt=format)` and `Service.complete(req, ..., fmt=...)`
  take a Format; `complete` compiles `req.response_format` when none is
  given. Each request gets its own `Constraint` (`fmt.start()`), which the scheduler
  consults for that row only: the row's logits are masked to the tokens the
  grammar allows before sampling, and the token picked advances it. A row without a format pays
  nothing (no mask, no call). The masks of a step's rows are computed on a thread of their own
  while the model runs (llguidance lets go of the GIL), so they cost the batch little.
- Fails closed: the end-of-text ids (EOS, chat's end of turn) are allowed only when the grammar
  accepts, and the sequence ends by itself once the grammar can take nothing more; the piece
  that ends a formatted request says "stop" only when the grammar accepted its whole text
  (`Constraint.finished`), "length" otherwise (cut by max_tokens or the context).

The engine is llguidance (benchmarks/results/grammar_engines_cpu-*.md: why). JSON is generated
without free whitespace (", " and ": " as separators): a model cannot loop on blank lines, and
the document is short.
"""

from __future__ import annotations

import collections
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llnp
import numpy as np

from doel.serve.core.grammar_limits import limit_of, parser_limits, refusal
from doel.serve.edge.refusal import RequestError

# JSON as json.dumps writes it: no whitespace but after separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled formats kept, least recently used dropped
# The cache's bytes, estimated (`entry_bytes`): a client sending many large distinct schemas
# cannot make it hold more, whatever their count.
CACHE_BYTES = 128 << 20
# An entry's estimate: a compiled matcher holds about this much, plus ENTRY_PER_BYTE bytes per
# byte of its grammar's text (measured with llguidance 1.9 on doel's tokenizer: 80-100 KiB for
# a small schema, 25-35 bytes a byte for schemas of 10-20 KiB).
ENTRY_BASE = 96 << 10
ENTRY_PER_BYTE = 32
MAX_SCHEMA_CHARS = 1 << 20
# Masks are computed here while the scheduler's worker thread runs the model.
MASK_THREAD = ThreadPoolExecutor(1, thread_name_prefix="doel-grammar")


class Format:
    """A compiled grammar: immutable, shared by every request that names the same schema."""

    def __init__(self, grammars: Grammars, matcher: llguidance.LLMatcher, kind: str):
        self.grammars, self._proto, self.kind = grammars, matcher, kind
        self.size = 0  # the cache's estimate of its bytes (`entry_bytes`)

    def start(self) -> Constraint:
        """A fresh state for one request (a copy of the compiled matcher: no compiling)."""
        return Constraint(self, self._proto.deep_copy())


class DeadEnd(RuntimeError):
    """The grammar allows no next token where the text so far does not complete a document, or
    it reached one of the engine's limits (a recursion with no way out grows the parse until
    one stops it): a dead end that compiling could not see. The scheduler ends that row
    ("length"), never the batch."""


class Constraint:
    """One sequence's place in its grammar. The scheduler calls `fill` (any thread), `mask`,
    then `advance` with the token picked; `done` ends the sequence, `finished` says whether the
    grammar accepted what was generated."""

    def __init__(self, fmt: Format, matcher: llguidance.LLMatcher):
        self.format, self.matcher = fmt, matcher
        self.finished = False  # the grammar accepted the text, and it ended there
        self.bits = llnp.allocate_token_bitmask(1, fmt.grammars.vocab_size)

    @property
    def done(self) -> bool:
        """No token can follow (the document is complete), or the matcher failed."""
        return self.finished or self.matcher.is_stopped()

    def fill(self) -> None:
        """Compute the next token's mask into `bits` (llguidance lets go of the GIL)."""
        llnp.fill_next_token_bitmask(self.matcher, self.bits)

    def mask(self, logits: np.ndarray, stop_ids: tuple[int, ...]) -> np.ndarray:
        """`logits` with every token the grammar forbids at -inf, after `fill`. The stop ids
        (EOS, end of turn) are allowed exactly when the grammar accepts the text so far."""
        n = len(logits)
        bits = self.bits[0].view(np.uint8)
        allowed = np.unpackbits(bits, count=n, bitorder="little").view(bool)  # 0/1: no copy
        eos = self.format.grammars.eos_id
        if eos is not None and eos < n:
            allowed[eos] = False  # llguidance's own end token: only the request's stop ids end
        accepting = self.matcher.is_accepting()
        for i in stop_ids:
            if i < n:
                allowed[i] = accepting
        if not allowed.any():
            raise DeadEnd(f"the grammar allows no token: {self.matcher.get_error()}")
        return np.where(allowed, logits, -np.inf)

    def advance(self, token: int | None) -> None:
        """Take the token picked; None: a stop id, which the mask allowed only if accepting."""
        if token is None:
            self.finished = self.matcher.is_accepting()
            return
        if not self.matcher.consume_token(token):
            why = self.matcher.get_error()
            if limit_of(why):  # past one of the engine's limits (grammar_limits): this row ends
                raise DeadEnd(f"the grammar reached a limit: {' '.join(why.split())[:300]}")
            raise RuntimeError(f"the grammar refused token {token}: {why}")
        if self.matcher.is_stopped():
            self.finished = self.matcher.is_accepting() and not self.matcher.is_error()


def fill_all(constraints: list[Constraint]) -> Future:
    """Compute the masks of these constraints on the grammar thread; the caller runs the model
    meanwhile and waits on the future before sampling."""
    return MASK_THREAD.submit(lambda: [c.fill() for c in constraints])


class Grammars:
    """The compilers of one tokenizer, with a cache of compiled formats keyed by their text."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int | None = None):
        # n_vocab: the model's logits may be wider than the tokenizer (padding ids); those
        # ids decode to nothing and are never allowed.
        self.vocab_size, self.eos_id = vocab_size, eos_id
        kwargs = {} if eos_id is None else {"eos_token": eos_id}
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, **kwargs)
        self._cache: collections.OrderedDict[str, Format] = collections.OrderedDict()
        self.cache_bytes = 0  # the estimate of what the cache holds (`entry_bytes`)
        self._lock = threading.Lock()

    def response_format(self, rf: dict | None, param: str = "response_format") -> Format | None:
        """OpenAI's response_format (or the Responses API's text.format) as a Format; None for
        `{"type": "text"}` or no format."""
        if rf is None:
            return None
        if not isinstance(rf, dict):
            raise RequestError(400, f"{param} must be an object with a 'type'", param)
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_schema({"type": "object"}, param)
        if kind == "json_schema":
            spec = rf.get("json_schema", rf)  # chat's nested shape, or the Responses API's flat
            where = f"{param}.json_schema" if "json_schema" in rf else param
            if not isinstance(spec, dict) or "schema" not in spec:
                raise RequestError(400, f"{where}.schema is missing; give a JSON schema", where)
            return self.json_schema(spec["schema"], f"{where}.schema")
        raise RequestError(
            400,
            f"{param}.type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
            f"{param}.type",
        )

    def json_schema(self, schema: dict | bool, param: str = "response_format") -> Format:
        """A JSON schema as a Format (true or {}: any JSON value)."""
        if schema is True:
            schema = {}
        if schema is False or not isinstance(schema, dict):
            raise RequestError(
                400, f"{param} must be a JSON schema object (false allows nothing)", param
            )
        text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
        if len(text) > MAX_SCHEMA_CHARS:
            raise RequestError(400, f"{param} is over {MAX_SCHEMA_CHARS:,} characters", param)
        return self._compiled(
            "json:" + text,
            lambda: llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS),
            "json_schema",
            param,
        )

    def lark(self, grammar: str, param: str) -> Format:
        """A grammar in llguidance's Lark dialect as a Format."""
        return self._compiled(
            "lark:" + grammar,
            lambda: llguidance.LLMatcher.grammar_from_lark(grammar),
            "lark",
            param,
        )

    def _compiled(self, key: str, build, kind: str, param: str) -> Format:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = build()
        except ValueError as e:
            raise RequestError(400, f"{param}: {e}", param) from None
        # The matcher's constructor lets go of the GIL as it compiles, and never raises: a
        # grammar it cannot build, or one past a limit, leaves it in an error state, which
        # names the keyword or the limit.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise RequestError(400, refusal(matcher.get_error(), param), param)
        self._refuse_empty(matcher, param)
        fmt = Format(self, matcher, kind)
        fmt.size = entry_bytes(grammar)
        self._keep(key, fmt)
        return fmt

    def _keep(self, key: str, fmt: Format) -> None:
        """Cache `fmt`, dropping the least recently used past CACHE_SIZE entries or CACHE_BYTES
        (one larger than the whole bound is not kept)."""
        if fmt.size > CACHE_BYTES:
            return
        with self._lock:
            if key in self._cache:  # compiled twice at once: the first one stays
                return
            self._cache[key] = fmt
            self.cache_bytes += fmt.size
            while len(self._cache) > CACHE_SIZE or self.cache_bytes > CACHE_BYTES:
                self.cache_bytes -= self._cache.popitem(last=False)[1].size

    def _refuse_empty(self, matcher: llguidance.LLMatcher, param: str) -> None:
        """A grammar that admits no document (a `$ref` cycle with no base case) compiles, but its
        first mask allows nothing: refused here, before the request queues. On a copy: filling
        the mask of such a grammar puts its matcher in an error state."""
        probe = matcher.deep_copy()
        bits = llnp.allocate_token_bitmask(1, self.vocab_size)
        llnp.fill_next_token_bitmask(probe, bits)
        allowed = np.unpackbits(bits[0].view(np.uint8), count=self.vocab_size, bitorder="little")
        if self.eos_id is not None and self.eos_id < self.vocab_size:
            allowed[self.eos_id] = 0  # llguidance's end token is no document
        if probe.is_error() and limit_of(probe.get_error()):
            raise RequestError(400, refusal(probe.get_error(), param), param)
        if probe.is_error() or not (allowed.any() or probe.is_accepting()):
            why = " ".join(probe.get_error().split())[:200] or "no first token is allowed"
            raise RequestError(
                400,
                f"{param} admits no document ({why}): every $ref cycle needs a way out (a "
                "property that is not required, an anyOf branch without the reference)",
                param,
            )


def entry_bytes(grammar: str) -> int:
    """The memory a compiled grammar holds, estimated from its text (ENTRY_BASE)."""
    return ENTRY_BASE + ENTRY_PER_BYTE * len(grammar)
