"""Several models in one server: `Models`, the registry of the bundles a doel-serve serves, each a
`Model` (name, folder, what it is, and whether it is loaded, loading, unloaded or failed).

The rules, as Ollama's keep_alive and llama.cpp's router mode have them:
- The first bundle is the default, answered when a request names no model. It is loaded as the
  server starts (every request is a 503 "Loading model" until then, as with one bundle). Every
  other one is loaded on its first request, which waits for it while requests to loaded models
  go on: the load runs on a worker thread, never on the event loop, as one task per load that a
  waiting request leaving does not cancel (a load cut short would leak what it built). Each
  load checks the bundle's files against its manifest's sha256 (unless --no-checksums).
- A model idle for `keep_alive` seconds is unloaded (-1: never): its scheduler is closed, every
  reference to its Service (engine, session, caches) dropped and collected, and the freed heap
  given back to the system (`give_back_heap`), so the process's resident memory falls.
- At most `max_models` are loaded. A load first unloads the least recently used idle models.
  When every loaded model has requests in flight, the load goes ahead over the limit and the
  surplus is unloaded as soon as one drains: no request waits for another model's requests to
  end, and none fails for them.
- A model with requests in flight is never unloaded: a request holds a lease from `get` to the
  last byte of its response (`LEASES`, which the app's ModelContext opens and releases).
- A model that fails to load is "failed": its requests are a 503 that says why and when it is
  tried again, and the other models are served as before. A transient cause (memory, I/O, an
  ONNX Runtime error: anything but a BundleError) is tried again by the first request after
  --load-retry seconds, doubled for each failure in a row up to 3 times it (`retry_in`; the 503s
  meanwhile carry Retry-After): one refused allocation must not need a restart, and a load costs
  seconds of CPU and memory, so clients retrying at once must not reload it continuously.
  llama-server's router and Ollama try again at every request (a failed child is "unloaded"
  with its exit code; a failed runner is expired). A damaged bundle (BundleError, Damaged: a
  hash mismatch) cannot load until its files change, so it is tried again once they do
  (`files_of`: each file's size and mtime), never before: a reload would hash it again.
Each model keeps its own Service: scheduler, slots, prefix cache, tenants' partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from doel.serve.core.engine import BundleError, read_bundle
from doel.serve.core.service import Service
from doel.serve.core.template import read_template
from doel.serve.core.verify import Damaged, Verification
from doel.serve.edge.refusal import RequestError
from doel.serve.endpoints.protocol import ModelCard, ModelList
from doel.serve.settings import Settings

log = logging.getLogger("doel.serve")
# The models a request holds (each `get` adds one), released when its response has ended.
LEASES: ContextVar[list | None] = ContextVar("doel_model_leases", default=None)
LOADING = "Loading model"


@dataclass(eq=False)
class Model:
    name: str
    folder: str
    chat: bool = False  # its tokenizer has a chat template (else a base model)
    quant: str | None = None
    context_length: int = 0
    state: str = "unloaded"  # one of metrics.MODEL_STATES
    service: Service | None = None  # while loaded
    error: str | None = None  # why it failed
    last_used: float = 0.0  # time.monotonic() of its last request's start or end
    in_flight: int = 0  # requests holding it
    loads: int = 0
    task: asyncio.Task | None = None  # its load, while loading
    failures: int = 0  # transient load failures in a row
    retry_at: float = 0.0  # time.monotonic() from which a transient failure is tried again
    files: tuple | None = None  # after a damaged bundle: its files then (`files_of`)


def describe(folder: str, name: str | None = None) -> Model:
    """What the bundle in `folder` is, read from its manifest and tokenizer config without
    loading it; a folder that is no bundle is a failed Model saying why."""
    model = Model(name or Path(folder).resolve().name, str(folder))
    files = files_of(folder)
    try:
        bundle = read_bundle(folder)
    except BundleError as e:
        model.state, model.error, model.files = "failed", str(e), files
        return model
    model.chat = read_template(Path(folder)) is not None
    model.quant = bundle.manifest.get("quant")
    model.context_length = bundle.context_length
    return model


def files_of(folder: str) -> tuple:
    """The bundle's files as they are now (name, size, mtime): a damaged bundle is loaded again
    once this changes. Empty for a folder that cannot be read."""
    try:
        with os.scandir(folder) as entries:
            stats = [(e.name, e.stat()) for e in entries]
    except OSError:
        return ()
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


def retry_in(base: float, failures: int) -> float:
    """Seconds before a load that failed `failures` times in a row is tried again: --load-retry,
    doubled for each failure after the first, at most 3 times it."""
    return min(base * 2 ** (failures - 1), 3 * base)


def give_back_heap() -> None:
    """glibc keeps freed heap for later allocations; malloc_trim returns it to the system, so
    that an unloaded model's memory leaves the resident set (nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _free(held: list) -> None:
    held.clear()
    gc.collect()
    give_back_heap()


def refusal(model: Model) -> RequestError:
    """The 503 of a model that failed: why, and when it is tried again (Retry-After)."""
    if model.files is not None:
        why = f"{model.error}; it is tried again once the bundle's files change"
        return RequestError(503, why, kind="unavailable_error")
    wait = max(1, math.ceil(model.retry_at - time.monotonic()))
    why = f"{model.error or LOADING}; tried again in {wait} s"
    error = RequestError(503, why, kind="unavailable_error")
    error.headers = {"Retry-After": str(wait)}
    return error


class Card(ModelCard):
    """A /v1/models entry with what the model is and whether it is loaded now."""

    chat: bool  # a chat model (its tokenizer has a chat template), else a base model
    quant: str | None = None  # doel.contracts.quant's name of its weights' quantization
    state: str  # one of metrics.MODEL_STATES


class Cards(ModelList):
    data: list[Card]


class Models:
    """The registry (see the module's rules). `on_change(model)` is called when a model's
    state changes; `on_damaged(error)` when a load finds a damaged bundle."""

    def __init__(
        self,
        settings: Settings,
        loader: Callable[[Settings], Service],
        on_change: Callable[[Model], None] = lambda _m: None,
        on_damaged: Callable[[Damaged], None] = lambda _e: None,
    ):
        self.settings, self.loader = settings, loader
        self.on_change, self.on_damaged = on_change, on_damaged
        self.all: dict[str, Model] = {}
        for i, folder in enumerate((settings.bundle, *settings.bundles)):
            model = describe(folder, settings.model_name if i == 0 else None)
            if model.name in self.all:
                raise ValueError(f"two bundles are named {model.name!r}: {folder}")
            self.all[model.name] = model
        self.default = next(iter(self.all.values()))
        self.started = False  # the default's load at startup has ended
        self.metrics = None  # the app's Metrics, given to each loaded Service
        self._first_check = settings.verify  # the default's, begun by doel-serve: its first load
        self._tasks: set[asyncio.Task] = set()

    # --- what a request gets -------------------------------------------------------------

    def find(self, name: str | None) -> Model:
        if name is None:
            return self.default
        model = self.all.get(name)
        if model is None:
            there = ", ".join(repr(n) for n in self.all)
            raise RequestError(
                404,
                f"the model {name!r} does not exist; this server has {there}",
                "model",
                "model_not_found",
            )
        return model

    async def get(self, name: str | None = None) -> Service:
        """The Service of the model `name` (None: the default), loaded if it is not; held for
        the request (`LEASES`) so that it is not unloaded under it. 404 for a name this server
        does not have, 503 while the server starts or for a model that failed."""
        model = self.find(name)
        if not self.started:
            raise RequestError(503, LOADING, kind="unavailable_error")
        leases = LEASES.get()
        if leases is not None:
            leases.append(model)
            model.in_flight += 1
        model.last_used = time.monotonic()
        while model.service is None:
            if model.state == "failed" and not self._may_retry(model):
                raise refusal(model)
            if model.task is None:
                model.task = self._spawn(self._load(model))
            await asyncio.shield(model.task)  # a request that leaves does not cancel the load
        return model.service

    def release(self, model: Model) -> None:
        """A request holding `model` has ended."""
        model.in_flight -= 1
        model.last_used = time.monotonic()
        if model.in_flight == 0 and self._over_limit():
            self._spawn(self._trim())

    def check_ready(self) -> None:
        """For /health and /v1/models: 503 while the default model loads at startup, or when
        every model failed."""
        if not self.started:
            raise RequestError(503, LOADING, kind="unavailable_error")
        if all(m.state == "failed" for m in self.all.values()):
            raise refusal(self.default)

    def states(self) -> dict[str, str]:
        return {m.name: m.state for m in self.all.values()}

    def cards(self, created: int) -> Cards:
        return Cards(
            data=[
                Card(
                    id=m.name,
                    created=created,
                    max_model_len=m.context_length,
                    chat=m.chat,
                    quant=m.quant,
                    state=m.state,
                )
                for m in self.all.values()
            ]
        )

    def context_length(self) -> int | None:
        """The longest context of the models, which bounds a request's token ids before its
        model is known; None when there is none."""
        return max((m.context_length for m in self.all.values() if m.context_length), default=None)

    def loaded(self) -> list[Service]:
        return [m.service for m in self.all.values() if m.service is not None]

    # --- loading and unloading -----------------------------------------------------------

    async def start(self) -> None:
        """Load the default model (the server's startup), and watch for idle models."""
        if self.settings.keep_alive >= 0:
            self._spawn(self._reap())
        try:
            if self.default.state != "failed":
                self.default.task = self._spawn(self._load(self.default))
                await asyncio.shield(self.default.task)
        finally:
            self.started = True

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for model in self.all.values():
            if model.service is not None:
                await model.service.scheduler.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _set(self, model: Model, state: str, error: str | None = None) -> None:
        model.state, model.error = state, error
        self.on_change(model)

    def _may_retry(self, model: Model) -> bool:
        """Whether a failed model is due to be loaded again (see the module's rules)."""
        if model.files is None:
            return time.monotonic() >= model.retry_at
        if files_of(model.folder) == model.files:
            return False
        fresh = describe(model.folder, model.name)  # what it is now, or why it is no bundle
        model.chat, model.quant = fresh.chat, fresh.quant
        model.context_length = fresh.context_length
        if fresh.state == "failed":
            model.files = fresh.files
            self._set(model, "failed", fresh.error)
            return False
        return True

    def _failed(self, model: Model, error: str, files: tuple | None) -> None:
        """`model`'s load failed: damaged with `files` (tried again once they change), or for a
        transient cause (files None: tried again after the backoff)."""
        model.files = files
        if files is None:
            model.failures += 1
            model.retry_at = time.monotonic() + retry_in(self.settings.load_retry, model.failures)
        self._set(model, "failed", error)

    async def _load(self, model: Model) -> None:
        try:
            self._set(model, "loading")
            await self._make_room(model)
            start, files = time.perf_counter(), files_of(model.folder)
            try:
                svc = await asyncio.to_thread(self._build, model)
            except BundleError as e:  # Damaged among them: not until the files change
                damaged = isinstance(e, Damaged)
                what = "the bundle is damaged" if damaged else "the folder cannot be served"
                self._failed(model, f"{what}: {e}", files)
                log.error("%s", e)
                if damaged:
                    self.on_damaged(e)
                return
            except Exception as e:  # said on /health and to its requests; the server stays up
                log.exception("loading %s failed", model.folder)
                self._failed(model, f"loading the model failed: {type(e).__name__}: {e}", None)
                return
            if self.metrics is not None:
                svc.metrics = self.metrics
            model.service, model.loads, model.last_used = svc, model.loads + 1, time.monotonic()
            model.failures, model.files = 0, None
            self._set(model, "loaded")
            log.info(
                "model %s loaded in %.2f s (%d MB of it on 2 MB pages)",
                model.name,
                time.perf_counter() - start,
                svc.engine.huge_bytes >> 20,
            )
        finally:
            model.task = None

    def _build(self, model: Model) -> Service:
        """The model's Service (on a worker thread): the loader given the model's own Settings,
        its files checked as it loads (doel-serve started the default's check already)."""
        verify = None
        if model is self.default and self._first_check is not None:
            verify, self._first_check = self._first_check, None  # not again after a failure
        elif self.settings.checksums:
            verify = Verification(read_bundle(model.folder))
        own = dataclasses.replace(
            self.settings, bundle=model.folder, model_name=model.name, bundles=(), verify=verify
        )
        return self.loader(own)

    async def unload(self, model: Model) -> None:
        """Let the model go: scheduler closed, every reference dropped, memory given back."""
        svc = model.service
        if svc is None:
            return
        model.service = None
        self._set(model, "unloaded")
        await svc.scheduler.close()
        held = [svc]
        del svc
        await asyncio.to_thread(_free, held)
        log.info("model %s unloaded", model.name)

    def _held(self, but: Model | None = None) -> list[Model]:
        """The models loaded or loading (`but` apart)."""
        return [
            m
            for m in self.all.values()
            if m is not but and (m.service is not None or m.state == "loading")
        ]

    def _over_limit(self) -> bool:
        return len(self._held()) > self.settings.max_models

    def _idle_lru(self, among: list[Model]) -> Model | None:
        idle = [m for m in among if m.service is not None and m.in_flight == 0]
        return min(idle, key=lambda m: m.last_used, default=None)

    async def _make_room(self, model: Model) -> None:
        """Unload idle models, least recently used first, until `model` fits the limit; when
        every loaded one is busy, `release` unloads the surplus once one drains."""
        while len(held := self._held(but=model)) >= self.settings.max_models:
            victim = self._idle_lru(held)
            if victim is None:
                return
            await self.unload(victim)

    async def _trim(self) -> None:
        while self._over_limit() and (victim := self._idle_lru(self._held())) is not None:
            await self.unload(victim)

    async def _reap(self) -> None:
        """Unload the models idle for keep_alive seconds (and any surplus over the limit)."""
        keep = self.settings.keep_alive
        period = min(1.0, max(keep / 4, 0.05))
        while True:
            await asyncio.sleep(period)
            try:
                now = time.monotonic()
                for model in list(self.all.values()):
                    idle = model.service is not None and model.in_flight == 0
                    if idle and now - model.last_used >= keep:
                        await self.unload(model)
                await self._trim()
            except Exception:  # a bug here must not end the watch for good
                log.exception("unloading idle models failed")
