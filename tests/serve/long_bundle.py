"""A tiny random model with a longer context than the session's tiny bundle (96 positions), for
the tests whose prompts carry tool definitions (tests/serve/endpoints/test_tools.py): built once
per session
beside the other fixtures' folders, and reused by any module that asks for it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

CONTEXT = 1024


def long_bundle(tmp_path_factory, tokenizer_path: Path, tiny_model_config) -> Path:
    """The bundle's folder: `tiny_model_config` with CONTEXT positions, exported at fp32."""
    out = tmp_path_factory.getbasetemp() / "long-bundle"
    if (out / "manifest.json").is_file():
        return out
    import torch

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.hf import save_model
    from doel.train.model import Llama

    cfg = dataclasses.replace(tiny_model_config, max_position_embeddings=CONTEXT)
    torch.manual_seed(0)
    ckpt = save_model(Llama(cfg), out.parent / "long-ckpt", tokenizer=tokenizer_path)
    export_checkpoint(ckpt, out, ExportOptions(quant="fp32", eval_tokens=64, log=lambda _m: None))
    return out
