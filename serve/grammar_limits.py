"""What one request's grammar may cost the server, and how a grammar past it is refused.

- `PARSER_LIMITS`: llguidance's parser limits (LLParserLimits), each set here rather than left to
  the engine's defaults, so that the work and memory one request's grammar may take are this
  server's decision; `refusal` turns the engine's error for one into a 400 that names the
  limit and its value (or, for a schema the engine cannot enforce, the keyword).
- `compiled`: a compile on a thread of its own, off the event loop, bounded in time
  (--compile-timeout): past it the request is a 400, and the loop serves the other clients
  throughout.

The compiled-format cache's bound in bytes is `structured`'s (CACHE_BYTES); the bounds on what
a request may send (tools, input) are `bounds`'.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import llguidance

from doel.serve.bounds import limits
from doel.serve.refusal import RequestError

# llguidance's parser limits (LLParserLimits), set here, not left to its defaults, so that what
# one request's grammar may cost is this server's decision. A grammar past one is a 400 naming
# it (`LIMIT_WORDS`), when compiled or at its first mask; past one later, its row ends
# ("length"), the others carry on. The realistic schemas of the tests and the benchmark need a
# small fraction of each (a 400-token walk: under 10,000 step fuel, a few hundred states).
PARSER_LIMITS = {
    # Regex work while compiling (about 50 per µs): a 5,000-property schema fits.
    "initial_lexer_fuel": 1_000_000,
    # Grammar symbols: bounds the size of a compiled grammar, and so its memory.
    "max_grammar_size": 500_000,
    # Regex work for one token's mask (about 14 per µs): about 7 ms at most, which the mask
    # thread hides behind the model's step; llguidance allows twice that.
    "step_lexer_fuel": 100_000,
    # Earley items for one token's mask (about 20 per µs): about 1 ms.
    "step_max_items": 20_000,
    # Lexer states, built as masks are computed and kept with the compiled grammar (1-2 KiB
    # each): 40 MB at most a grammar, where llguidance's 250,000 allows 500 MB.
    "max_lexer_states": 20_000,
    # Items in one row of the parse: a row this wide is a grammar that explodes.
    "max_items_in_row": 2_000,
}
# The words of llguidance's error for each limit (parser/src: grammar_builder.rs, parser.rs,
# regexvec.rs).
LIMIT_WORDS = {
    "initial lexer configuration": "initial_lexer_fuel",
    "limits.initial_lexer_fuel": "initial_lexer_fuel",
    "DNF too large": "initial_lexer_fuel",
    "grammar size (number of symbols)": "max_grammar_size",
    "too many expressions constructed": "step_lexer_fuel",
    "too many states": "max_lexer_states",
    "Too many items": "step_max_items",
    "Current row has": "max_items_in_row",
}
# Compiles run here, off the event loop and apart from the tokenizer's threads: a slow compile
# holds no thread that encodes prompts.
COMPILE_THREADS = ThreadPoolExecutor(2, thread_name_prefix="doel-compile")


def parser_limits() -> llguidance.LLParserLimits:
    # Terse errors: a refusal is one line, with no parser state in it.
    return llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)


async def compiled(param: str, compile_, *args):
    """`compile_(*args)` (a Grammars compiler, or the Service's) on a compile thread, or a 400
    naming `param` once it takes over --compile-timeout seconds: the event loop serves the
    other clients meanwhile. The engine cannot be interrupted: a compile past the bound runs on
    to its end (its limits keep that short) and is cached, but nobody waits for it."""
    seconds = limits().compile_timeout
    work = asyncio.get_running_loop().run_in_executor(COMPILE_THREADS, compile_, *args)
    try:
        return await asyncio.wait_for(work, seconds)
    except TimeoutError:
        raise RequestError(
            400,
            f"{param} took over {seconds:g} s to compile, this server's limit "
            "(--compile-timeout); simplify it",
            param,
        ) from None


def limit_of(engine_message: str) -> str | None:
    """The PARSER_LIMITS name an engine error is about, or None."""
    return next((name for w, name in LIMIT_WORDS.items() if w in engine_message), None)


def refusal(engine_message: str, param: str) -> str:
    """The one-line refusal of a grammar the engine will not run: past one of its limits (named,
    with this server's value), or a schema it cannot enforce; the engine's own words name the
    keyword (`Unimplemented keys: ["not"]`, `Unknown format: ...`, a regex feature)."""
    why = " ".join(engine_message.split())[:300]
    limit = limit_of(engine_message)
    if limit is not None:
        return (
            f"{param} is past this server's grammar limit {limit} ({PARSER_LIMITS[limit]:,}): "
            f"{why}; simplify it (fewer alternatives, shorter patterns, less nesting)"
        )
    return (
        f"{param} cannot be enforced by this server's grammar engine (llguidance): {why}; "
        "remove or rewrite that part of the schema"
    )
