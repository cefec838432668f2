"""A tiny random model with a longer context than the session's tiny bundle (96 positions), for
the tests whose prompts carry tool definitions (tests/serve/endpoints/test_tools.py) and those
that fill the KV pool (tests/serve/core): built once per session beside the other fixtures'
folders, and reused by any module that asks for it; with the random prompts and the greedy runs
of the pool's tests."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np

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


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` random prompts of `length` ids from the tokenizer's ordinary range."""
    rng = np.random.default_rng(seed)
    return [rng.integers(8, 2000, size=length).tolist() for _ in range(n)]


async def run_all(scheduler, asks: list[list[int]], new: int) -> list[list[int]]:
    """The greedy ids of each prompt of `asks`, `new` of them at most, run together."""
    from doel.serve.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0)

    async def one(p):
        return [t async for t in scheduler.generate(p, params)]

    return await asyncio.gather(*(one(p) for p in asks))
