"""Shared fixtures: the built-in sample corpus and a small tokenizer trained on it in-process,
so every test is hermetic (no download, no ../shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.textio import resolve_sources
from train.tokenizer import TokenizerConfig, train_tokenizer

SAMPLE = Path(__file__).resolve().parents[1] / "train" / "sample"


@pytest.fixture(scope="session")
def sample_paths() -> list[str]:
    return [str(SAMPLE / "bn.txt"), str(SAMPLE / "en.txt")]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, sample_paths) -> Path:
    out = tmp_path_factory.mktemp("tok")
    cfg = TokenizerConfig(vocab_size=2048, min_frequency=1)
    return train_tokenizer(resolve_sources(sample_paths), cfg, out, progress=False)


@pytest.fixture(scope="session")
def tok(tokenizer_path):
    from train.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path)
