"""torch.compile as a run uses it (issue 56, items 3 and 7): each transformer block compiled
before any wrapper, one graph serving every layer, the eager model left eager; the checks before
step 1 (parity's small batch) leave the training shape served by its one static graph, never a
dynamic-shape graph; a machine without inductor's toolchain is refused in one line naming the
package. (Under DDP and FSDP: tests/train/test_dist.py.)"""

from __future__ import annotations

import pytest
import torch

from doel.train.build import BlocksCompiled, build_parts, compile_preflight
from doel.train.checks.suite import verify_before_training
from doel.train.common import DoelError
from doel.train.step import train_step

# Dynamo reads `.grad` of a block's input, a non-leaf activation, and hides torch's warning about
# it with a display filter, which pytest's filterwarnings=error turns into an exception.
NON_LEAF_GRAD = "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
pytestmark = pytest.mark.filterwarnings(NON_LEAF_GRAD)


def _symbolic(inputs) -> bool:
    for a in inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in a.shape):
            return True
    return False


@pytest.fixture
def recorded(monkeypatch):
    """torch.compile with a recording backend (no inductor: each graph runs eagerly): the list
    of every graph dynamo makes, its inputs' shapes and whether any is symbolic."""
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
    yield graphs
    torch._dynamo.reset()


def test_the_blocks_are_compiled_one_graph_for_every_layer_and_the_eager_model_stays_eager(
    recorded, shards, tiny_config
):
    cfg = tiny_config("compile=true", "batch_size=4", "model.num_hidden_layers=3")
    parts = build_parts(cfg, shards, log=lambda s: None)
    assert isinstance(parts.compiled, BlocksCompiled) and parts.compiled._orig_mod is parts.model
    # The warm-up traced one block graph (the activations (4, 64, C) in) for all 3 layers.
    hidden = cfg.model.hidden_size
    assert len(recorded) == 1 and recorded[0]["shapes"][0] == (4, 64, hidden), recorded
    x, y = (torch.as_tensor(a) for a in parts.loader.peek(1)[0])
    with torch.no_grad():
        eager = parts.model(x, y)  # the eager module: no graph, whatever the mode and shape
        parts.model(x[:1], y[:1])
    assert len(recorded) == 1
    with torch.no_grad():
        fast = parts.compiled(x, y)
    assert len(recorded) == 2  # no_grad is a graph of its own, still one for every layer
    assert torch.allclose(fast, eager, rtol=1e-5, atol=1e-6)
    # Parameter names as the eager model's behind the `_orig_mod.` prefix torch.compile uses.
    names = {n.removeprefix("_orig_mod.") for n, _ in parts.compiled.named_parameters()}
    assert names == {n for n, _ in parts.model.named_parameters()}


def test_the_parity_check_leaves_the_training_shape_one_static_graph(recorded, shards, tiny_config):
    """Parity calls the compiled model at (2, 64) between the warm-up and the first step at
    (4, 64): that must be a block graph of its own, and the step must need no new one."""
    cfg = tiny_config("compile=true", "batch_size=4")
    parts = build_parts(cfg, shards, log=lambda s: None)
    after_warmup = len(recorded)
    assert after_warmup >= 1
    report = verify_before_training(parts, log=lambda s: None, names=["parity"])
    assert report.ok, report.format()
    hidden = cfg.model.hidden_size
    assert any((2, 64, hidden) in g["shapes"] for g in recorded[after_warmup:]), "parity ran"
    before_step = len(recorded)
    x, y = (torch.as_tensor(a) for a in parts.loader.peek(1)[0])
    assert tuple(x.shape) == (4, 64)
    train_step(parts.compiled, parts.optimizer, [(x, y)], cfg.lr, cfg.grad_clip, parts.ctx)
    assert len(recorded) == before_step, "the training shape was compiled again after parity"
    assert not [g for g in recorded if g["symbolic"]], "a dynamic-shape graph was made"


def test_activation_checkpointing_is_traced_into_the_block_graph(recorded, shards, tiny_config):
    cfg = tiny_config("compile=true", "activation_checkpointing=true")
    parts = build_parts(cfg, shards, log=lambda s: None)
    assert isinstance(parts.compiled, BlocksCompiled)  # fullgraph: no break at the checkpoint
    assert len(recorded) == 1


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
