"""doel-export --embeddings (export/embedder.py): the graph written into a finished bundle is the
checkpoint's last hidden state, pooled as the manifest says and normalized (checked here against
transformers' own hidden states, not the export's module), its file recorded with its sha256,
the manifest still one doel reads; and the refusals, in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from doel.contracts.checksums import sha256_file
from doel.contracts.manifest import read_manifest
from doel.export.cli import build_parser
from doel.export.common import ExportError

embedder = pytest.importorskip("doel.export.embedder", reason="the export extra")


def test_the_flag_takes_a_pooling_mean_by_default():
    parse = build_parser().parse_args
    assert parse(["ckpt", "--out", "b", "--embeddings"]).embeddings == "mean"
    assert parse(["ckpt", "--out", "b", "--embeddings", "last"]).embeddings == "last"
    assert parse(["ckpt", "--out", "b"]).embeddings is None


def test_a_pooling_it_does_not_know_and_a_folder_that_is_no_bundle_are_refused(tmp_path):
    with pytest.raises(ExportError, match="--embeddings must be one of mean, last"):
        embedder.add_embeddings(tmp_path, tmp_path, "max")
    with pytest.raises(ExportError, match="no manifest.json"):
        embedder.add_embeddings(tmp_path, tmp_path, "mean")


def test_last_pooling_is_the_last_tokens_normalized_state_and_the_manifest_records_it(
    tiny_bundle, tmp_path, tok
):
    import onnxruntime as ort
    import torch
    from transformers import AutoModel

    ckpt, bundle = tiny_bundle.parent / "serve-ckpt", tmp_path / "b"
    shutil.copytree(tiny_bundle, bundle)
    record = embedder.add_embeddings(ckpt, bundle, "last", log=lambda _m: None)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["embeddings"] == record and record["pooling"] == "last"
    assert record["normalized"] and record["max_abs_diff"] <= embedder.PARITY_BOUND
    assert manifest["files"]["embeddings.onnx"]["sha256"] == sha256_file(bundle / "embeddings.onnx")
    assert read_manifest(bundle).extra["embeddings"] == record  # still a manifest doel reads
    texts = ["নদীর ধারে একটি গ্রাম", "hi"]
    rows = [tok.encode(t).ids for t in texts]
    session = ort.InferenceSession(str(bundle / "embeddings.onnx"))
    got = session.run(None, dict(zip(("input_ids", "attention_mask"), embedder.batch(rows))))[0]
    model = AutoModel.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    for row, vector in zip(rows, got):
        with torch.no_grad():
            state = model(torch.tensor([row])).last_hidden_state[0, -1].numpy()
        assert record["dimensions"] == len(vector) == len(state)
        np.testing.assert_allclose(vector, state / np.linalg.norm(state), atol=1e-5)
