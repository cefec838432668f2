"""POST /v1/embeddings: each input's vector from the bundle's embeddings graph (doel-export
--embeddings: the last hidden state, pooled as its manifest says, normalized), in OpenAI's
shape.

An `Encoder` a model holds the graph's ONNX Runtime session, loaded on the first request (its
file checked against the sha256 its manifest records) and run on a thread of its own, one batch
at a time: a request's inputs are tokenized (texts with the tokenizer's special tokens, as
/tokenize does; ids as they are) and wait for the thread with the other requests' (each run
takes every input waiting, so concurrent requests share runs), then are sorted by length and
run in batches of at most BATCH_TOKENS padded positions, so that a list of short texts costs one
run, not one each, and a long text does not pad a batch of short ones. Every input must fit
the model's context (its graph reads a text whole); a longer one is refused by index, not cut.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort

from doel.contracts.checksums import sha256_file
from doel.serve.core.service import RequestError, Service
from doel.serve.edge.bounds import limits
from doel.serve.endpoints.embeddings.protocol import (
    Embedding,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbeddingsUsage,
    encoded,
)

BATCH_TOKENS = 8192  # padded positions in one run: the activations stay a few MB
HINT = "export it with doel-export CHECKPOINT --out DIR --embeddings"


class Encoder:
    """One model's embeddings graph and the thread that runs it."""

    def __init__(self, folder: Path, record: dict, threads: int):
        path = folder / str(record.get("model", ""))
        if path.parent != folder or not path.is_file():
            raise RequestError(400, f"the bundle {folder.name} lacks its embeddings graph; {HINT}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.pooling, self.dimensions = record.get("pooling"), int(record["dimensions"])
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="doel-embed")
        self.pending: list[tuple[list[list[int]], asyncio.Future]] = []
        self.lock = threading.Lock()

    async def embed(self, rows: list[list[int]]) -> np.ndarray:
        """The vectors of one request's `rows`, run together with the other requests' that
        wait while a batch runs (one thread: the next run takes all of them)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self.lock:
            self.pending.append((rows, done))
        self.thread.submit(self._drain, loop)
        return await done

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        with self.lock:
            waiting, self.pending = self.pending, []
        waiting = [(rows, done) for rows, done in waiting if not done.cancelled()]
        if not waiting:
            return
        try:
            out, at = self.encode([r for rows, _ in waiting for r in rows]), 0
        except Exception as e:  # each request fails with it (a 500 naming its type)
            for _, done in waiting:
                loop.call_soon_threadsafe(_settle, done, None, e)
            return
        for rows, done in waiting:
            loop.call_soon_threadsafe(_settle, done, out[at : at + len(rows)], None)
            at += len(rows)

    def encode(self, rows: list[list[int]]) -> np.ndarray:
        """The vectors of `rows` (token id lists), in their order: [len(rows), dimensions]."""
        out = np.zeros((len(rows), self.dimensions), np.float32)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        start = 0
        while start < len(order):
            end = start + 1  # the longest row comes last: a batch's width is its last row's
            while end < len(order) and (end + 1 - start) * len(rows[order[end]]) <= BATCH_TOKENS:
                end += 1
            chunk = [rows[i] for i in order[start:end]]
            out[order[start:end]] = self._run(chunk)
            start = end
        return out

    def _run(self, rows: list[list[int]]) -> np.ndarray:
        width = max(map(len, rows))
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]


def _settle(done: asyncio.Future, result, error) -> None:
    if done.done():  # its client left
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


_ENCODERS: weakref.WeakKeyDictionary[Service, Encoder] = weakref.WeakKeyDictionary()
_LOADING = threading.Lock()


def encoder(svc: Service) -> Encoder:
    """The model's Encoder, loaded once (call off the event loop); a 400 for a bundle exported
    without --embeddings, or whose graph does not match its manifest."""
    with _LOADING:
        if svc in _ENCODERS:
            return _ENCODERS[svc]
        bundle = svc.engine.bundle
        record = bundle.manifest.get("embeddings")
        if not isinstance(record, dict):
            raise RequestError(
                400, f"the model {svc.name!r} was exported without embeddings; {HINT}", "model"
            )
        name = str(record.get("model", ""))
        want = (bundle.manifest.get("files") or {}).get(name, {}).get("sha256")
        path = Path(bundle.folder) / name
        if want is None or not path.is_file() or sha256_file(path) != want:
            raise RequestError(
                400, f"{path} does not match the sha256 its manifest records; {HINT}", "model"
            )
        _ENCODERS[svc] = Encoder(Path(bundle.folder), record, limits().threads)
        return _ENCODERS[svc]


def rows(svc: Service, req: EmbeddingsRequest) -> list[list[int]]:
    """Each input's token ids, checked against the vocabulary and the context."""
    items = req.inputs()
    texts = [x for x in items if isinstance(x, str)]
    encoded_texts = iter(e.ids for e in svc.tokenizer.encode_batch_fast(texts)) if texts else None
    out = []
    for i, x in enumerate(items):
        ids = next(encoded_texts) if isinstance(x, str) else x
        where = "input" if len(items) == 1 else f"input[{i}]"
        if not isinstance(x, str):
            svc.check_ids(ids, where)
        if len(ids) > svc.context_length:
            raise RequestError(
                400,
                f"{where} is {len(ids):,} tokens, over the model's context of "
                f"{svc.context_length}; shorten it (it is not cut)",
                "input",
            )
        if not ids:
            raise RequestError(400, f"{where} has no tokens; send text or ids to embed", "input")
        out.append(ids)
    return out


async def embed(svc: Service, req: EmbeddingsRequest) -> EmbeddingsResponse:
    loop = asyncio.get_running_loop()
    enc = await loop.run_in_executor(None, encoder, svc)
    if req.dimensions is not None and req.dimensions != enc.dimensions:
        raise RequestError(
            400,
            f"dimensions {req.dimensions} is not supported: this model's embeddings have "
            f"{enc.dimensions}, not trained to be shortened; unset dimensions",
            "dimensions",
        )
    ids = await svc.in_thread(rows, svc, req)
    vectors = await enc.embed(ids)
    data = [
        Embedding(index=i, embedding=encoded(v, req.encoding_format)) for i, v in enumerate(vectors)
    ]
    n = sum(map(len, ids))
    usage = EmbeddingsUsage(prompt_tokens=n, total_tokens=n)
    return EmbeddingsResponse(data=data, model=svc.name, usage=usage)
