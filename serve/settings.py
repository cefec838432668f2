"""`Settings`: what a server is started with, and the one home of every serve default.

doel-serve's flags, `create_app`, `Service`, the `Scheduler` and the `Guard` take their defaults
from these fields (`Settings.max_queue`, or `dataclasses.fields(Settings)`), as torchtitan and
vLLM derive their command lines from one config, so that no default is written twice (a test
reads the parser and every serve signature against it). Standard library only: the command line
reads it before the serve extra is imported, to say which package is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from doel.serve.edge.tenants import DEFAULT_MODE

if TYPE_CHECKING:  # it loads onnxruntime, which the command line imports later
    from doel.serve.core.verify import Verification


@dataclass(frozen=True)
class Settings:
    bundle: str
    model_name: str | None = None  # default: the bundle folder's name
    # Bundles served beside `bundle` (the default, answered when a request names no model): the
    # command line's other BUNDLE arguments and the bundles in --models DIR (serve/core/models.py).
    bundles: tuple[str, ...] = ()
    # Seconds a model stays loaded after its last request; -1: never unloaded. Ollama's
    # keep_alive and its 5 minutes: an idle model's memory is given back on a laptop.
    keep_alive: float = 300.0
    # Models loaded at once; one more unloads the least recently used idle one first. Ollama
    # loads 3 at most on a CPU.
    max_models: int = 3
    # Seconds before a model whose load failed for a transient cause (memory, I/O, the runtime)
    # is loaded again by its next request, doubled for each failure in a row up to 3 times it; 0:
    # every request tries again, as llama-server's router and Ollama do. A damaged bundle is
    # tried again once its files change instead (serve/core/models.py).
    load_retry: float = 10.0
    checksums: bool = True  # each load hashes the bundle's files against its manifest
    threads: int = 0  # ONNX Runtime intra-op threads; 0: one per core
    api_key: str | None = None  # when set, `Authorization: Bearer KEY` on all but /health
    max_queue: int = 16  # requests waiting for a slot before 429
    slots: int = 4  # sequences decoded together
    # Positions of KV cache the slots share (llama-server's -c); 0: slots x the model's
    # context, as far as half the memory available at load allows (shared by the models that
    # may be loaded). Taken as sequences grow and given back as they end; nothing is reserved
    # for max_tokens, and the youngest sequence is preempted when the pool is full
    # (docs/serving.md#memory).
    kv_positions: int = 0
    # Prompt tokens plus decoding rows in one step (llama-server's -ub, vLLM's token budget):
    # prompt chunks shrink to leave room for the rows that decode beside them, and prompts that
    # wait together share a step. Chosen by measurement among 24-512 (the --step-tokens rows of
    # benchmarks/results/serve_load_0.4b_cpu-amd-avx512-vnni.md): fewer, fuller prefill steps
    # keep the p95 gap between tokens low (at a longer p99 gap); smaller budgets stall more
    # steps a little each, and lengthen the time to first token.
    step_tokens: int = 512
    # Seconds a finished sequence's cache stays in its slot for a next turn to reuse; then its
    # memory goes back, so an idle server holds almost none.
    prefix_keep: float = 300.0
    # Ids a lone decoding sequence drafts by prompt lookup and verifies in one run (llama-server's
    # --spec-draft-n-max with --spec-type ngram-simple); 0: no drafting. Chosen, and drafting
    # kept to one decoding sequence, by benchmarks/results/spec_* (serve/core/step.py says why).
    draft_tokens: int = 6
    max_body_bytes: int = 1 << 20  # a request body; more is 413
    cors_origins: tuple[str, ...] = ()  # none: CORS off
    max_headers: int = 256  # as vLLM; more is refused with 431
    allowed_hosts: tuple[str, ...] | None = None  # Host names answered (any port); None: any
    docs: bool = False  # /docs, /redoc, /openapi.json (the pages load their scripts from a CDN)
    url: str | None = None  # the server's address, printed in one line once the model is ready
    api_keys: dict[str, str] | None = None  # {key: tenant} (tenants.parse_keys); with api_key: both
    prefix_cache: str = DEFAULT_MODE  # per-tenant, shared or off (tenants.MODES)
    # Messages in one chat request; more is a 400. A long conversation has a few hundred turns,
    # and each costs validation and rendering.
    max_messages: int = 512
    # Body bytes a client may send a second (ratelimit.BodyBudget); 0: any.
    client_body_rate: int = 1 << 20
    # Requests a client may send a second (ratelimit.RequestRate); 0: any. No person, chat page
    # or agent meets it (each waits for its answers); a harness sending many at once fits in the
    # burst; a flood meets it within seconds and is then refused before routing.
    client_request_rate: int = 50
    # Functions in one request's tools; more is a 400. Each is shown in the prompt and, with
    # tool_choice required, compiled into the reply's grammar. OpenAI's own bound.
    max_tools: int = 128
    # Bytes of one tool's parameters schema (compact JSON); more is a 400. It is shown in the
    # prompt and compiled; a real one is a few KiB.
    max_tool_schema_bytes: int = 1 << 16
    # Items in one /v1/responses input (or /v1/embeddings' inputs); more is a 400. Each is
    # validated, then rendered as a chat message (which --max-messages bounds too).
    max_input_items: int = 512
    # UTF-8 bytes of the texts of one /v1/responses input (or /v1/embeddings') together; more
    # is a 400. Far over any doel model's context (a token is several bytes), read before
    # anything is rendered.
    max_input_bytes: int = 1 << 19
    # Seconds one schema or grammar may take to compile (on a thread of its own); longer is a
    # 400. The engine's own limits (grammar_limits.PARSER_LIMITS) keep a compile well under it.
    compile_timeout: float = 5.0
    # Seconds one write of a streamed answer may wait for the client to take it; then the
    # response ends, its generation stops and its model's lease ends (docs/serving.md). A send
    # waits only once the socket's buffers are full: a client that reads, however slowly, never
    # meets it; one that stopped reading would otherwise hold its slot and model for ever.
    # llama-server's --timeout (read and write) is 3600 s; a minute frees a slot sooner.
    write_timeout: float = 60.0
    verify: Verification | None = None  # the bundle's hashes being checked, while it loads
    exit_on_damage: bool = False  # doel-serve: a damaged bundle stops the server
