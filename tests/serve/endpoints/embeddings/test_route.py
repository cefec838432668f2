"""POST /v1/embeddings with the official `openai` client on a live doel-serve whose bundle was
exported with --embeddings: unit vectors of the manifest's dimensions, base64 (the client's
default) and float alike; a batch equal to each input alone (padding reads nothing); token ids
equal to their text; usage; the refusals (dimensions, an empty text, --max-input-items, a model
exported without embeddings); /metrics counting the route."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import httpx2
import numpy as np
import pytest
from live_server import live_server

from doel.serve.core.service import RequestError
from doel.serve.endpoints.embeddings.route import Encoder, encoder

openai = pytest.importorskip("openai", reason="the dev extra: pip install 'doel[dev]'")

TEXTS = ["নদীর ধারে একটি ছোট গ্রাম", "ঢাকা", "The river runs past a small village, slowly."]
MAX_ITEMS = 4


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    from doel.export.embedder import add_embeddings  # the export extra

    folder = tmp_path_factory.mktemp("embeddings")
    bundle = folder / "embed-bundle"
    shutil.copytree(tiny_bundle, bundle)
    add_embeddings(tiny_bundle.parent / "serve-ckpt", bundle, "mean", log=lambda _m: None)
    with live_server(bundle, folder, "--max-input-items", str(MAX_ITEMS)) as s:
        s.model = bundle.name
        s.dimensions = json.loads((bundle / "manifest.json").read_text())["embeddings"][
            "dimensions"
        ]
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    http = openai.DefaultHttpxClient(trust_env=False)
    c = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30, http_client=http
    )
    yield c
    c.close()


def _vectors(r) -> np.ndarray:
    return np.array([d.embedding for d in sorted(r.data, key=lambda d: d.index)])


def test_a_batch_is_unit_vectors_equal_to_each_input_alone_in_either_encoding(client, server):
    r = client.embeddings.create(model=server.model, input=TEXTS)  # base64, decoded by the client
    assert r.object == "list" and r.model == server.model and [d.index for d in r.data] == [0, 1, 2]
    got = _vectors(r)
    assert got.shape == (len(TEXTS), server.dimensions)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    as_floats = client.embeddings.create(model=server.model, input=TEXTS, encoding_format="float")
    np.testing.assert_array_equal(_vectors(as_floats), got)
    alone = np.concatenate([_vectors(client.embeddings.create(input=t, model=server.model))
                            for t in TEXTS])  # fmt: skip
    np.testing.assert_allclose(alone, got, atol=1e-5)
    assert len({tuple(np.round(v, 4)) for v in got}) == len(TEXTS)  # no two alike


def test_token_ids_embed_as_their_text_and_usage_counts_them(client, server):
    with httpx2.Client(base_url=server.url, trust_env=False, timeout=30) as http:
        ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    r = client.embeddings.create(model=server.model, input=ids)
    np.testing.assert_allclose(_vectors(r), _vectors(client.embeddings.create(
        model=server.model, input=TEXTS)), atol=1e-6)  # fmt: skip
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=server.model, input=ids[0])
    np.testing.assert_allclose(_vectors(one)[0], _vectors(r)[0], atol=1e-5)


def _refused(client, server, **kw) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=server.model, **kw)
    return e.value.body["message"]


def test_the_refusals_name_what_to_change(client, server):
    assert "unset dimensions" in _refused(client, server, input="x", dimensions=3)
    assert "empty string" in _refused(client, server, input=["x", ""])
    said = _refused(client, server, input=["x"] * (MAX_ITEMS + 1))
    assert "--max-input-items" in said
    assert "outside the vocabulary" in _refused(client, server, input=[[1 << 30]])
    with httpx2.Client(base_url=server.url, trust_env=False, timeout=30) as http:
        metrics = http.get("/metrics").text
    assert 'route="/v1/embeddings",status="200"' in metrics
    assert 'route="/v1/embeddings",status="400"' in metrics


def test_a_model_exported_without_embeddings_is_a_400_that_says_how_to_export_it():
    bundle = types.SimpleNamespace(manifest={}, folder="b")
    svc = types.SimpleNamespace(engine=types.SimpleNamespace(bundle=bundle), name="m")
    with pytest.raises(RequestError, match="doel-export CHECKPOINT --out DIR --embeddings") as e:
        encoder(svc)
    assert e.value.status == 400


class _Session:
    """A graph whose vector is the sum of a row's ids; it counts its runs."""

    def __init__(self):
        self.runs = 0

    def run(self, _names, feed):
        self.runs += 1
        return [(feed["input_ids"] * feed["attention_mask"]).sum(1, keepdims=True) * 1.0]


def test_requests_that_wait_together_share_one_run_and_each_gets_its_own_rows():
    enc = Encoder.__new__(Encoder)
    enc.session, enc.dimensions = _Session(), 1
    enc.thread, enc.pending, enc.lock = ThreadPoolExecutor(1), [], threading.Lock()
    hold = threading.Event()
    enc.thread.submit(hold.wait, 10)  # a batch running: the requests below wait together
    asks = [[[1, 2], [3]], [[10]], [[5, 5, 5], [7], [1]]]

    async def main():
        tasks = [asyncio.ensure_future(enc.embed(rows)) for rows in asks]
        await asyncio.sleep(0.05)
        hold.set()
        return await asyncio.gather(*tasks)

    got = asyncio.run(main())
    assert [v[:, 0].tolist() for v in got] == [[3, 3], [10], [15, 7, 1]]
    assert enc.session.runs == 1
