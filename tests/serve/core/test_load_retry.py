"""A model whose load failed is tried again (serve/core/models.py): after a transient cause (memory,
I/O, the runtime) once --load-retry seconds have passed, the wait doubling with each failure in
a row up to 3 times it, its 503s saying when (Retry-After); after a damaged bundle, once its
files change, and not before (each load hashes the bundle again: no reload loop on files that
cannot load). The loaders are planted to fail, so each test takes a second or two."""

from __future__ import annotations

import shutil
import time

import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.serve.core import models
from doel.serve.edge.app import create_app, default_loader
from doel.serve.settings import Settings

RETRY = 0.3  # --load-retry of these tests
BODY = {"prompt": "নদীর ধারে", "max_tokens": 2, "temperature": 0}


def failing(first: list[Exception]):
    """default_loader, which raises `first`'s errors on its first calls; `calls` counts them."""
    calls = []

    def load(settings: Settings):
        calls.append(settings.model_name)
        if len(calls) <= len(first):
            raise first[len(calls) - 1]
        return default_loader(settings)

    return load, calls


def started(c: TestClient, timeout: float = 30) -> None:
    """The server's startup load has ended, loaded or failed."""
    end = time.monotonic() + timeout
    while c.get("/health").json().get("error", {}).get("message") == models.LOADING:
        assert time.monotonic() < end
        time.sleep(0.02)


def test_a_load_that_failed_for_a_transient_cause_is_tried_again_after_the_backoff(tiny_bundle):
    """The default's load runs out of memory once as the server starts: its requests are a 503
    naming the cause and when it is tried again (Retry-After), none of them loading again
    meanwhile; the first request after --load-retry loads it and is answered."""
    load, calls = failing([MemoryError("cannot allocate 2 GiB")])
    settings = Settings(bundle=str(tiny_bundle), threads=1, load_retry=RETRY)
    with TestClient(create_app(settings, loader=load)) as c:
        started(c)
        failed_at = time.monotonic()
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        message = r.json()["error"]["message"]
        assert "MemoryError: cannot allocate 2 GiB" in message and "tried again in" in message
        health = c.get("/health")
        assert health.status_code == 503 and health.headers["Retry-After"] == "1"
        assert len(calls) == 1  # refused, not loaded again, within the backoff
        time.sleep(max(0.0, failed_at + RETRY - time.monotonic()) + 0.05)
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert len(calls) == 2 and ready(c).get("/health").json()["models"] == {
            tiny_bundle.name: "loaded"
        }


def test_a_model_loaded_on_request_is_tried_again_by_the_request_after_the_backoff(
    tiny_bundle, tmp_path
):
    """A second model whose load fails twice (an I/O error, then ONNX Runtime's): the request
    that found the first failure is a 503, the next one before the backoff is too without a
    load, the one after it loads again and fails with the new cause, waiting twice as long, and
    the one after that is answered. The default model is served throughout."""
    other = tmp_path / "other"
    shutil.copytree(tiny_bundle, other)
    load, calls = failing([OSError("EIO"), RuntimeError("onnxruntime: bad alloc")])

    def planted(settings: Settings):  # the default loads as ever
        return load(settings) if settings.model_name == "other" else default_loader(settings)

    settings = Settings(bundle=str(tiny_bundle), bundles=(str(other),), threads=1, load_retry=RETRY)
    with TestClient(create_app(settings, loader=planted)) as c:
        ready(c)
        body = BODY | {"model": "other"}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and "OSError: EIO" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=body).status_code == 503 and len(calls) == 1
        assert c.post("/v1/completions", json=BODY).status_code == 200  # the default, as ever
        time.sleep(RETRY + 0.05)
        r = c.post("/v1/completions", json=body)
        failed_at = time.monotonic()
        assert r.status_code == 503 and "bad alloc" in r.json()["error"]["message"]
        assert len(calls) == 2
        time.sleep(RETRY)  # half the second backoff: still refused, not loaded
        assert c.post("/v1/completions", json=body).status_code == 503 and len(calls) == 2
        time.sleep(max(0.0, failed_at + 2 * RETRY - time.monotonic()) + 0.05)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "other", r.text
        assert len(calls) == 3


def test_the_backoff_doubles_with_each_failure_in_a_row_up_to_three_times_the_setting():
    assert [models.retry_in(10.0, n) for n in (1, 2, 3, 4, 9)] == [10, 20, 30, 30, 30]
    assert models.retry_in(0.0, 5) == 0  # --load-retry 0: every request tries again


def test_a_damaged_bundle_stays_refused_until_its_files_change(tiny_bundle, tmp_path):
    """32 bytes of the weights flipped: the load finds the sha256 differs, and the bundle is
    not loaded (and hashed) again, however long, while its files are as they were; written
    back, the next request loads it."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny_bundle, folder)
    data = folder / "model.onnx.data"
    good = data.read_bytes()
    middle = len(good) // 2
    data.write_bytes(
        good[:middle] + bytes(b ^ 0xFF for b in good[middle : middle + 32]) + good[middle + 32 :]
    )
    load, calls = failing([])
    settings = Settings(bundle=str(folder), threads=1, load_retry=0.05)
    with TestClient(create_app(settings, loader=load)) as c:
        started(c)
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and "Retry-After" not in r.headers
        message = r.json()["error"]["message"]
        assert message.startswith("the bundle is damaged: ") and "files change" in message
        time.sleep(0.2)  # four backoffs: a transient failure would have been tried again
        assert c.post("/v1/completions", json=BODY).json()["error"]["message"] == message
        assert len(calls) == 1
        data.write_bytes(good)
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert len(calls) == 2


def test_a_negative_backoff_is_refused_in_one_line(tiny_bundle):
    from doel.serve.cli import main

    with pytest.raises(SystemExit, match="error: --load-retry must be 0 or more"):
        main([str(tiny_bundle), "--load-retry", "-1"])


def test_a_folder_that_was_no_bundle_is_described_and_loaded_once_it_is_one(tiny_bundle, tmp_path):
    """A second folder empty as the server starts is failed ("no bundle"), and stays so; once a
    bundle is copied in, its next request loads it, and /v1/models says what it now is."""
    late = tmp_path / "late"
    late.mkdir()
    settings = Settings(bundle=str(tiny_bundle), bundles=(str(late),), threads=1)
    with TestClient(create_app(settings)) as c:
        ready(c)
        body = BODY | {"model": "late"}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and "files change" in r.json()["error"]["message"], r.text
        shutil.copytree(tiny_bundle, late, dirs_exist_ok=True)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        card = {m["id"]: m for m in c.get("/v1/models").json()["data"]}["late"]
        assert card["state"] == "loaded" and card["max_model_len"] > 0 and card["chat"]
