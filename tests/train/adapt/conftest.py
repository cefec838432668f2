"""Fixtures of the import tests: the tiny Hugging Face folder and its GGUFs (tiny_sources.py),
made once a session, and the real model (SmolLM2-135M-Instruct's GGUF), taken from the cache
that .ci/outside_tools fills (`python -m doel.train.adapt.smollm2`) and imported once: without it
the tests that read it skip, saying so in one line. No test downloads anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from adapt.tiny_sources import hf_folder, write_gguf

from doel.train.adapt.smollm2 import smollm2_gguf


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    """A random tiny Llama with a tied head and a ChatML byte-level tokenizer, as transformers
    saves it (read-only for the tests)."""
    return hf_folder(tmp_path_factory.mktemp("tiny-hf") / "model")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf, tmp_path_factory):
    """`make(qtype="F32", **changes)`: `tiny_hf` written as a GGUF (tiny_sources.write_gguf),
    each kind once a session."""
    made: dict[str, Path] = {}

    def make(qtype: str = "F32", **changes) -> Path:
        key = f"{qtype}-{sorted(changes.items())!r}"
        if key not in made:
            out = tmp_path_factory.mktemp("tiny-gguf") / f"tiny-{qtype}.gguf"
            made[key] = write_gguf(tiny_hf, out, qtype, **changes)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    path, why = smollm2_gguf(download=False)
    if path is None:
        pytest.skip(f"the real model is not here: {why}")
    return path


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_file, tmp_path_factory) -> Path:
    """The real model imported once a session (about 5 s and 540 MB)."""
    from doel.train.adapt.importing import import_model

    return import_model(smollm2_file, tmp_path_factory.mktemp("smollm2") / "model", log=print)
