"""The HTTP server: `create_app(settings)` → a FastAPI app with OpenAI-compatible completions, chat
completions, responses and embeddings, and Anthropic's messages.

The model loads in `lifespan`, in a worker thread, so the port answers at once: `/health` says
503 while loading (as llama.cpp's server does) and 200 when ready. Every refusal is a 4xx with
an OpenAI-style error body that says what is wrong; nothing a client sends gives a 5xx. A bug's
exception is answered with an OpenAI-style 500, counted in /metrics; a stream that fails past
its head ends with an error event instead (serve/edge/answer.py).

`add_routes` is serve's one list of endpoints. Adding one touches its module (the work: a
`Route`, as `completions` and `chat` are), its request and response models and that list:
/metrics counts it under its own path (`CountRequests` reads the app's router), the OpenAPI
page lists it, the Guard asks it for the API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from doel.contracts.errors import error_body
from doel.serve import playground
from doel.serve.core.models import LEASES, Cards, Model, Models
from doel.serve.core.service import RequestError, Service
from doel.serve.core.verify import Damaged
from doel.serve.edge.answer import failure, respond, unless_gone
from doel.serve.edge.bounds import LIMITS
from doel.serve.edge.guard import AllowedHosts, Guard
from doel.serve.edge.jsonbody import decode_error, parse_failure
from doel.serve.edge.metrics import CountRequests, Metrics
from doel.serve.endpoints.chat import route as chat
from doel.serve.endpoints.chat.protocol import MESSAGE_LIMIT, ChatCompletion, ChatCompletionRequest
from doel.serve.endpoints.completions import route as completion
from doel.serve.endpoints.embeddings import route as embeddings
from doel.serve.endpoints.embeddings.protocol import EmbeddingsRequest, EmbeddingsResponse
from doel.serve.endpoints.messages import route as messages
from doel.serve.endpoints.messages.errors import AnthropicErrors
from doel.serve.endpoints.messages.protocol import CountTokensRequest, MessagesRequest
from doel.serve.endpoints.protocol import (
    CONTEXT_LENGTH,
    MAX_ERRORS_SHOWN,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from doel.serve.endpoints.responses import route as responses
from doel.serve.endpoints.responses.protocol import ResponsesRequest
from doel.serve.settings import Settings

log = logging.getLogger("doel.serve")
ERRORS = {
    400: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


def error(status: int, message: str, kind: str, param: str | None = None, headers=None):
    """A refusal as a response, its body the one the middleware and the connection write too."""
    body = error_body(status, message, kind, param)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first few problems, each cut to 200 characters (a field's name can be long), and
    how many more: a client learns what to fix without a megabyte of errors."""
    errors, parts, param = exc.errors(), [], None
    for e in errors[:MAX_ERRORS_SHOWN]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0][:200] if loc else None)
        part = f"{'.'.join(loc) or 'body'}: {e.get('msg')}"
        parts.append(part if len(part) <= 200 else part[:199] + "…")
    if len(errors) > MAX_ERRORS_SHOWN:
        parts.append(f"and {len(errors) - MAX_ERRORS_SHOWN:,} more problems")
    return "; ".join(parts) or "invalid request", param


def install_errors(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _refused(_req, exc: RequestError):
        return error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        not_json = decode_error(exc.errors(), exc.body)  # where, not a position as its param
        message, param = (not_json, None) if not_json else _validation_message(exc)
        return error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        # FastAPI's "There was an error parsing the body" names no reason; its cause does.
        why = parse_failure(exc.__cause__) if exc.status_code == 400 else None
        return error(exc.status_code, why or str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _failed(_req, exc: Exception):
        # A bug, not the client's doing. Starlette logs the traceback after this answer, and
        # CountRequests counts it among the 500s. A stream past its head says it in its last
        # event instead (answer.EventStream), in the same words.
        said = failure(exc)
        return error(500, said.message, said.kind)


async def service(request: Request, model: str | None = None) -> Service:
    """The Service of the model a request names (None: the default), loaded if it is not; a
    404 for a name this server does not have, a 503 while the server starts (models.py)."""
    return await request.app.state.models.get(model)


def make_lifespan(settings: Settings, models: Models):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        models.metrics = app.state.metrics

        async def start():
            await models.start()
            if models.default.state != "loaded":
                return
            if settings.url:  # the line a user looks for, whatever the log level
                key = "; key required" if settings.api_key or settings.api_keys else ""
                print(
                    f"doel-serve: {models.default.name} ready at {settings.url}/v1 (OpenAI "
                    f"API{key}), playground at {settings.url}/",
                    flush=True,
                )
                others = [m.name for m in models.all.values() if m is not models.default]
                if others:
                    print(
                        f"doel-serve: also {', '.join(others)}, each loaded on its first request",
                        flush=True,
                    )
            else:
                log.info("model %s ready", models.default.name)

        task = asyncio.create_task(start())
        yield
        task.cancel()
        await models.close()

    return lifespan


def damaged(settings: Settings, models: Models, e: Damaged) -> None:
    """A bundle file that is not what its manifest records, found as a model loads: one line,
    no traceback (models.py logs it). A doel-serve of one bundle then exits with status 1;
    nothing has been served (every request was a 503 while loading), and uvicorn's graceful
    stop would end the process by the signal it stopped for, not with a status a script can
    read. Among several models, the damaged one is "failed" and the others are served."""
    if not settings.exit_on_damage or len(models.all) > 1:
        return
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def default_service(app: FastAPI, models: Models, model: Model) -> None:
    """`app.state.service`: the default model's Service while it is loaded (tests read it)."""
    if model is models.default:
        app.state.service = model.service


def default_loader(settings: Settings) -> Service:
    svc = Service.load(
        settings.bundle,
        settings.threads,
        settings.model_name,
        settings.max_queue,
        settings.slots,
        # the models that may be loaded at once share the memory a default pool takes
        models=min(settings.max_models, 1 + len(settings.bundles)),
        kv_positions=settings.kv_positions,
        step_tokens=settings.step_tokens,
        prefix_keep=settings.prefix_keep,
        draft_tokens=settings.draft_tokens,
    )
    if settings.verify is not None:  # hashing since doel-serve started, beside the load
        seconds = settings.verify.wait()
        log.info("bundle files match their manifest's sha256 (%.2f s)", seconds)
    return svc


def add_routes(app: FastAPI, settings: Settings) -> None:
    """Serve's endpoints, the one list of them (the module docstring says what reads it)."""
    page, font = playground.page(settings.bundle), playground.font()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground_page():
        return HTMLResponse(page)

    @app.get(playground.FONT_PATH, include_in_schema=False)
    async def playground_font():
        return Response(font, media_type="font/woff2", headers={"Cache-Control": "max-age=86400"})

    keyed = bool(settings.api_key or settings.api_keys)

    @app.get("/health", responses=ERRORS)
    async def health(request: Request):
        """200 once the server has started and some model can be served, with each model's
        state, unless a key guards the API: /health answers without one, so it names no model
        then (/metrics, behind the key, does)."""
        models: Models = request.app.state.models
        models.check_ready()
        return {"status": "ok"} if keyed else {"status": "ok", "models": models.states()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request):
        models: Models = request.app.state.models
        scheds = [svc.scheduler for svc in models.loaded()]
        waiting, running = sum(len(s.waiting) for s in scheds), sum(len(s.running) for s in scheds)
        states = [(m.name, m.state, m.loads) for m in models.all.values()]
        drafts = sum(s.drafted for s in scheds), sum(s.accepted for s in scheds)
        text = request.app.state.metrics.render(waiting, running, states, drafts)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=Cards)
    async def models(request: Request):
        request.app.state.models.check_ready()
        return request.app.state.models.cards(int(time.time()))

    @app.post("/v1/completions", response_model=Completion, responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request):
        return await respond(request, completion, await service(request, req.model), req)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await respond(request, chat, await service(request, req.model), req)

    @app.post("/v1/responses", responses=ERRORS)
    async def create_response(req: ResponsesRequest, request: Request):
        return await respond(request, responses, await service(request, req.model), req)

    @app.post("/v1/messages", responses=ERRORS)
    async def create_message(req: MessagesRequest, request: Request):
        """Anthropic's Messages API (serve/endpoints/messages), errors in its shape."""
        return await respond(request, messages, await service(request, req.model), req)

    @app.post("/v1/messages/count_tokens", responses=ERRORS)
    async def count_message_tokens(req: CountTokensRequest, request: Request):
        return await messages.count(await service(request, req.model), req)

    @app.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=ERRORS)
    async def create_embeddings(req: EmbeddingsRequest, request: Request):
        svc = await service(request, req.model)
        return await unless_gone(request, embeddings.embed(svc, req))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(req: TokenizeRequest, request: Request):
        svc = await service(request, req.model)
        ids = await svc.in_thread(svc.encode, req.prompt, req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=svc.context_length)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(req: DetokenizeRequest, request: Request):
        svc = await service(request, req.model)
        return DetokenizeResponse(prompt=await svc.in_thread(svc.decode, req.tokens))


class ModelContext:
    """ASGI middleware: token-id lists in a request are bounded by the models' longest context
    (protocol.CONTEXT_LENGTH; its own model's is checked once it is known), and a chat's
    messages by --max-messages (MESSAGE_LIMIT), which the body's validation reads. The models
    a request holds (`LEASES`: `Models.get`) are released when its response has ended, its
    last streamed byte included."""

    def __init__(self, app, state, max_messages: int = Settings.max_messages, settings=None):
        self.app, self.state, self.max_messages = app, state, max_messages
        self.settings = settings  # the other bounds of a request (bounds.LIMITS)

    async def __call__(self, scope, receive, send):
        messages = MESSAGE_LIMIT.set(self.max_messages)
        limits = LIMITS.set(self.settings) if self.settings is not None else None
        models: Models = self.state.models
        context = models.context_length()
        token = CONTEXT_LENGTH.set(context) if context is not None else None
        held = LEASES.set([])
        try:
            return await self.app(scope, receive, send)
        finally:
            for model in LEASES.get():
                models.release(model)
            LEASES.reset(held)
            if token is not None:
                CONTEXT_LENGTH.reset(token)
            MESSAGE_LIMIT.reset(messages)
            if limits is not None:
                LIMITS.reset(limits)


def create_app(settings: Settings, loader: Callable[[Settings], Service] | None = None) -> FastAPI:
    """The app; `loader` builds the Service (tests pass their own to control loading)."""
    pages = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"}
    models = Models(
        settings,
        loader or default_loader,
        on_change=lambda m: default_service(app, models, m),
        on_damaged=lambda e: damaged(settings, models, e),
    )
    app = FastAPI(
        title="doel",
        lifespan=make_lifespan(settings, models),
        **{k: v if settings.docs else None for k, v in pages.items()},
    )
    app.state.models, app.state.service = models, None
    app.state.metrics = Metrics()
    app.state.prefix_cache = settings.prefix_cache  # read by `respond`
    install_errors(app)
    add_routes(app, settings)
    # Innermost: only the routes read it.
    app.add_middleware(
        ModelContext, state=app.state, max_messages=settings.max_messages, settings=settings
    )
    # The last added is the outermost: CountRequests → AnthropicErrors → AllowedHosts → CORS →
    # Guard → routes.
    # A Host not ours is refused before anything else. CORS outside the key check answers a
    # browser's preflight (which carries no key) and puts its headers on a 401, so that a page
    # can read why it was refused.
    app.add_middleware(
        Guard,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        max_headers=settings.max_headers,
        keys=settings.api_keys,
        body_rate=settings.client_body_rate,
        request_rate=settings.client_request_rate,
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(AllowedHosts, hosts=settings.allowed_hosts)
    # Every refusal under /v1/messages, the Guard's and AllowedHosts' included, in Anthropic's
    # error shape.
    app.add_middleware(AnthropicErrors)
    # Outermost: counts 401s too. Its route names are the router's (add_routes), not a list of
    # its own.
    app.add_middleware(CountRequests, metrics=app.state.metrics, router=app.router)
    return app
