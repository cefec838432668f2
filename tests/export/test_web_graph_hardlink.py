"""export/web_graph.py reads a bundle whose weights file is hard-linked (`cp -l`, a
deduplicating store), which onnx.load refuses as a "hardlink attack", and gives the page's
graph the same weights; a weights file outside the bundle's folder (a `..` location, a symlink
out) is still refused, in one line."""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from doel.export.common import ExportError
from doel.export.web_graph import web_graph


def weights(path) -> dict[str, np.ndarray]:
    """A graph's initializers (onnx.load: its data file must have one link)."""
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def small_bundle(folder, data: str = "model.onnx.data"):
    """A two-matmul graph whose weights (and a Constant's value) lie in `data`."""
    rng = np.random.default_rng(0)
    w1, w2, c = (rng.standard_normal(s).astype(np.float32) for s in ((8, 6), (6, 4), (4,)))
    nodes = [
        helper.make_node("Constant", [], ["C"], value=numpy_helper.from_array(c, "C")),
        helper.make_node("MatMul", ["A", "W1"], ["H"]),
        helper.make_node("MatMul", ["H", "W2"], ["Z"]),
        helper.make_node("Add", ["Z", "C"], ["Y"]),
    ]
    g = helper.make_graph(
        nodes,
        "small",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")],
    )
    folder.mkdir()
    onnx.save(
        helper.make_model(g),
        str(folder / "model.onnx"),
        save_as_external_data=True,
        location=data,
        size_threshold=0,
    )
    return folder / "model.onnx", {"W1": w1, "W2": w2, "C": c}


def linked(src, dst):
    """`dst`: every file of `src` hard-linked (cp -l)."""
    dst.mkdir()
    for f in src.iterdir():
        os.link(f, dst / f.name)
    return dst


def test_a_hard_linked_bundle_gives_the_page_graph_its_own_weights(tmp_path):
    model, want = small_bundle(tmp_path / "bundle")
    copy = linked(model.parent, tmp_path / "linked")
    assert (copy / "model.onnx.data").stat().st_nlink == 2
    out = tmp_path / "out"
    out.mkdir()
    web_graph(copy / "model.onnx", out, "model.onnx", "page.data")
    g = onnx.load(str(out / "model.onnx")).graph
    got = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    got["C"] = numpy_helper.to_array(
        next(n for n in g.node if n.op_type == "Constant").attribute[0].t
    )
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


@pytest.mark.parametrize("how", ["dotdot", "symlink"])
def test_a_weights_file_outside_the_bundle_is_refused(tmp_path, how):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(4096))
    model, _ = small_bundle(tmp_path / "bundle")
    if how == "symlink":
        data = model.parent / "model.onnx.data"
        data.unlink()
        data.symlink_to(secret)
    else:
        m = onnx.load(str(model), load_external_data=False)
        for t in m.graph.initializer:
            next(e for e in t.external_data if e.key == "location").value = "../secret.bin"
        onnx.save(m, str(model))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ExportError, match=r"not a file in .*: export the bundle again$"):
        web_graph(model, out, "model.onnx", "page.data")


def test_a_hard_linked_tiny_bundle_exports_its_page_graphs(tiny_bundle, tmp_path):
    """The test suite's exported bundle (conftest's tiny_bundle), copied, then hard-linked: each
    page graph web_graph writes holds the bundle's weights (logits_to_keep aside)."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)  # links to a copy: the session's bundle keeps one link
    bundle = linked(copy, tmp_path / "linked")
    want = weights(tiny_bundle / "model.onnx")
    for kind in ("bundle", "int8"):
        out = tmp_path / f"page-{kind}"
        out.mkdir()
        facts = web_graph(bundle / "model.onnx", out, "model.onnx", "model.onnx.data", kind)
        assert facts["rewritten_matmuls"] == 0  # fp32: no MatMulNBits
        got = weights(out / "model.onnx")
        assert set(want) - set(got) <= {"logits_to_keep"} and set(got) <= set(want)
        for name, value in got.items():
            np.testing.assert_array_equal(value, want[name])
