"""benchmarks/runtimes/page_numerics.py: the page's kernel held to ONNX Runtime by its loss and
logits beside ONNX Runtime's own rounding noise, on the tiny model's int4 web export."""

import json
import shutil

import numpy as np
import pytest

from benchmarks.runtimes import page_numerics as pn

TEXT = {
    "bn": ["নদীর ধারে একটি ছোট গ্রাম ছিল। সেখানে দোয়েল পাখি গান গাইত, সকালে আর সন্ধ্যায়।"] * 12,
    "en": ["The river was quiet that morning, and the bird sang by the old mill again."] * 12,
}
SIZES = {"n": 3, "size": 24}


@pytest.fixture(autouse=True)
def node():
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")


def test_nats_is_the_cross_entropy_of_the_next_ids():
    z = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1.0, 1.0, 1.0]], np.float32))
    assert pn.nats(z, [0, 1, 1]) == pytest.approx(-np.log(0.25) - np.log(0.8), rel=1e-6)


def test_the_nudged_copy_moves_only_the_embeddings_scales_and_still_serves(web_bundle, tmp_path):
    import onnx
    from onnx import numpy_helper

    from doel.serve.core.engine import read_bundle

    other = pn.nudged(web_bundle, tmp_path / "nudged")
    a, b = (onnx.load(str(d / "model.onnx")) for d in (web_bundle, other))
    moved = []
    for x, y in zip(a.graph.initializer, b.graph.initializer, strict=True):
        dx, dy = numpy_helper.to_array(x), numpy_helper.to_array(y)
        if not np.array_equal(dx, dy):
            assert np.all(np.nextafter(dx, np.float32(np.inf)) == dy), x.name
            moved.append(x.name)
    assert moved == ["model.embed_tokens.weight/scales"]
    read_bundle(other)  # its manifest's checksums were written again


def test_the_page_passes_where_it_computes_the_bundles_numbers(web_bundle):
    rows = pn.rows(web_bundle, TEXT, "test", **SIZES)
    assert len(rows) == 4 and all(r["ok"] for r in rows), rows


def test_a_page_that_reads_the_model_wrong_fails(web_bundle, tmp_path):
    """The kernel given another attention scale (what a misread of the graph would do): its
    logits leave ONNX Runtime's by more than the rounding moves them (on this random model the
    loss barely moves; on a real one it does, benchmarks/results/runtimes.md)."""
    bad = tmp_path / "bad"
    shutil.copytree(web_bundle, bad)
    spec = json.loads((bad / "web" / "web.json").read_text())
    spec["graphs"]["bundle"]["kernel"]["floats"][1] *= 4
    (bad / "web" / "web.json").write_text(json.dumps(spec))
    rows = pn.rows(bad, TEXT, "test", **SIZES)
    logit_rows = [r for r in rows if "largest logit" in r["check"]]
    assert len(logit_rows) == 2 and not any(r["ok"] for r in logit_rows), rows
