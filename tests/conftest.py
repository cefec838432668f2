"""Shared session fixtures, built once and reused by every module: the built-in sample corpus, a
small tokenizer trained on it in-process, token shards of the sample, the tiny training and
model configs, and a tiny export bundle. Every test is hermetic (no download, no ../shared)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from doel.train.config import load_config
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.textio import resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer
from doel.train.model import ModelConfig
from doel.train.settings import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "train" / "sample"
TINY = ROOT / "configs" / "tiny.toml"
BUNDLE_CONTEXT = 96  # positions of the tiny bundle's model

# One intra-op thread for the session. The tests' models are tiny, so a second thread buys
# little; on a 2-core machine busy with other work it costs many times over, as every parallel
# region waits until both threads are scheduled (README, development notes: the fast run's time).
# Spawned processes (fit, torchrun, doel-serve) choose their own threads.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def sample_paths() -> list[str]:
    return [str(SAMPLE / "bn.txt"), str(SAMPLE / "en.txt")]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, sample_paths) -> Path:
    out = tmp_path_factory.mktemp("tok")
    # The doel style, named: the session's tests check its split, its NFC and its refusal by the
    # GGUF export (the default spm style has tests of its own: tests/train/test_spm.py).
    cfg = TokenizerConfig(vocab_size=2048, min_frequency=1, style="doel")
    return train_tokenizer(resolve_sources(sample_paths), cfg, out, progress=False)


@pytest.fixture(scope="session")
def tok(tokenizer_path):
    return load_tokenizer(tokenizer_path)


@pytest.fixture(scope="session")
def shards(tmp_path_factory, tokenizer_path, sample_paths) -> Path:
    """The sample as token shards with a 10 % validation split (read-only for the tests)."""
    out = tmp_path_factory.mktemp("shards")
    prepare(tokenizer_path, sample_paths, out, PrepareConfig(val_fraction=0.1), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_config():
    """configs/tiny.toml with KEY=VALUE overrides: tiny_config("lr=1e-3")."""

    def make(*sets: str) -> TrainConfig:
        return load_config(TrainConfig, TINY, list(sets))

    return make


@pytest.fixture(scope="session")
def tiny_run_config(tiny_config):
    """`tiny_config` logging every step, for tests that read a run's lines or metrics rows."""

    def make(*sets: str) -> TrainConfig:
        return tiny_config("log_every=1", *sets)

    return make


@pytest.fixture(scope="session")
def tiny_model_config() -> ModelConfig:
    """A random 2-layer Llama on the session tokenizer's vocabulary (the tiny bundle's)."""
    return ModelConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=BUNDLE_CONTEXT,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tokenizer_path, tiny_model_config) -> Path:
    """`tiny_model_config`'s random model exported at fp32, once per session: the bundle every
    serve test runs on. Its checkpoint stays beside it, in serve-ckpt/, for tests that export it
    again (another engine, int4)."""
    out = tmp_path_factory.getbasetemp() / "serve-bundle"
    pytest.importorskip("onnxruntime_genai")
    torch = pytest.importorskip("torch")
    from doel.export.bundle import ExportOptions, export_checkpoint  # the export extra
    from doel.train.hf import save_model
    from doel.train.model import Llama

    torch.manual_seed(0)
    ckpt = save_model(Llama(tiny_model_config), out.parent / "serve-ckpt", tokenizer=tokenizer_path)
    export_checkpoint(ckpt, out, ExportOptions(quant="fp32", eval_tokens=64, log=lambda _m: None))
    return out


@pytest.fixture(scope="session")
def web_bundle(tiny_bundle, tmp_path_factory) -> Path:
    """tiny_bundle's checkpoint at int4 with --web, once per session (skips where the npm
    packages cannot come)."""
    from doel.export import web
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.common import ExportError

    try:
        web.runtime_modules(log=lambda _m: None)
    except ExportError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("web") / "bundle-int4"
    opts = ExportOptions(quant="int4", web=True, eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", out, opts)
    return out


# Fixtures that build an export bundle (here and in test modules): a test using one is slow.
BUNDLE_FIXTURES = {"tiny_bundle", "bundle", "fp32_bundle", "ckpt", "dry_run", "serve_spec"}


def pytest_collection_modifyitems(items):
    for item in items:
        if BUNDLE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
