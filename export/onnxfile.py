"""An ONNX model file rewritten in place (gate_up.py, embedding.py): read without its weights to
decide, its external weights brought into memory, and written back whole. The weights file is
written anew, not appended to: onnx.save appends to an existing file, which would leave the old
tensors in it beside the new ones.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import external_data_helper


def load_weights(m, model: Path) -> str | None:
    """Bring the weights of `m` (an ONNX model read from `model` without them) into memory; the
    name of its external weights file, or None where the graph holds its weights."""
    external = [t for t in m.graph.initializer if external_data_helper.uses_external_data(t)]
    location = {e.key: e.value for e in external[0].external_data}["location"] if external else None
    onnx.load_external_data_for_model(m, str(model.parent))
    return location


def save_rewritten(m, model: Path, location: str | None) -> None:
    """Write a rewritten `m` (every weight in memory) back to `model`, its weights to
    `location` beside it where it had one."""
    if location:
        (model.parent / location).unlink()
        onnx.save(m, str(model), save_as_external_data=True, location=location)
    else:
        onnx.save(m, str(model))
