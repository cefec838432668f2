"""export/graph.py's quiet block leaves the process's logging as it found it: an exporter that
configures the root logger (ONNX Runtime's MatMulNBits quantizer does, as it is imported) must
not make every later library's INFO lines part of doel's output."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from doel.export import graph


def test_a_root_logger_reconfigured_inside_is_restored():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with graph._quiet("an exporter"):
        logging.basicConfig(level=logging.DEBUG, force=True)  # drops and replaces the handlers
        assert root.level == logging.DEBUG
    assert root.handlers == handlers and root.level == level


def test_a_failing_exporter_restores_it_too():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with pytest.raises(graph.ExportError, match="an exporter failed: RuntimeError: no"):
        with graph._quiet("an exporter"):
            logging.basicConfig(level=logging.INFO, force=True)
            raise RuntimeError("no")
    assert root.handlers == handlers and root.level == level


@pytest.mark.slow  # a fresh interpreter, so the builder's modules are imported for the first time
def test_the_genai_builder_leaves_no_info_lines_printing_after_it(tmp_path, tiny_bundle):
    """The demo's path: onnxruntime-genai's builder (whose import calls basicConfig at INFO),
    then the GGUF writer's INFO line, which must not print (it did, time-stamped, in the demo's
    output)."""
    code = (
        "import logging\n"
        "from pathlib import Path\n"
        "from doel.export.checkpoint import inspect_checkpoint\n"
        "from doel.export.graph import build_genai\n"
        f"ckpt = inspect_checkpoint({str(tiny_bundle.parent / 'serve-ckpt')!r})\n"
        f"build_genai(ckpt, Path({str(tmp_path)!r}), 'fp32', 32)\n"
        "logging.getLogger('gguf.gguf_writer').info('a later library says something')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "model.onnx").is_file()
    assert "a later library" not in done.stderr + done.stdout
