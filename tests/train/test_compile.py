"""torch.compile as a run uses it (issue 56, items 3 and 7): the checks before step 1 (parity's
small batch) leave the training shape served by its one static graph, never a dynamic-shape
graph; a machine without inductor's toolchain is refused in one line naming the package."""

from __future__ import annotations

import pytest
import torch

from doel.train.build import build_parts, compile_preflight
from doel.train.checks.suite import verify_before_training
from doel.train.common import DoelError
from doel.train.step import train_step


def _symbolic(inputs) -> bool:
    for a in inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in a.shape):
            return True
    return False


def test_the_parity_check_leaves_the_training_shape_one_static_graph(
    monkeypatch, shards, tiny_config
):
    """A recording backend (no inductor: each graph runs eagerly) sees every graph dynamo
    makes. Parity calls the compiled model at (2, 64) between the warm-up and the first step
    at (4, 64): that must be a graph of its own, and the step must need no new one."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(
            {
                "symbolic": _symbolic(example_inputs),
                "shapes": [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)],
            }
        )
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend=recording, **kw))
    torch._dynamo.reset()
    cfg = tiny_config("compile=true", "batch_size=4")
    parts = build_parts(cfg, shards, log=lambda s: None)
    after_warmup = len(graphs)
    assert after_warmup >= 1
    report = verify_before_training(parts, log=lambda s: None, names=["parity"])
    assert report.ok, report.format()
    assert any((2, 64) in g["shapes"] for g in graphs[after_warmup:]), "parity's shape ran"
    before_step = len(graphs)
    x, y = (torch.as_tensor(a) for a in parts.loader.peek(1)[0])
    assert tuple(x.shape) == (4, 64)
    train_step(parts.compiled, parts.optimizer, [(x, y)], cfg.lr, cfg.grad_clip, parts.ctx)
    assert len(graphs) == before_step, "the training shape was compiled again after parity"
    assert not [g for g in graphs if g["symbolic"]], "a dynamic-shape graph was made"
    torch._dynamo.reset()


def test_the_preflight_names_the_missing_compiler():
    msg = compile_preflight(torch.device("cuda"), which=lambda name: None)
    assert "gcc" in msg and "build-essential" in msg and "compile=false" in msg
    assert "\n" not in msg


def test_the_preflight_names_python_h(tmp_path):
    msg = compile_preflight(torch.device("cpu"), which=lambda n: f"/usr/bin/{n}", include=tmp_path)
    assert "Python.h" in msg and "-dev" in msg and str(tmp_path) in msg


def test_the_preflight_passes_with_the_toolchain(tmp_path):
    (tmp_path / "Python.h").write_text("")
    assert compile_preflight(torch.device("cpu"), lambda n: f"/usr/bin/{n}", tmp_path) is None


def test_a_compiled_run_without_a_compiler_is_refused_before_training(
    monkeypatch, shards, tiny_config
):
    monkeypatch.setattr("doel.train.build.shutil.which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(DoelError, match="needs a C compiler"):
        build_parts(tiny_config("compile=true"), shards, log=lambda s: None)
