"""Fixtures the training tests share (the session's tokenizer and data are tests/conftest.py's)."""

from __future__ import annotations

import pytest
import torch

from doel.train.hf import save_model
from doel.train.model import Llama, ModelConfig


@pytest.fixture
def model_folder(tok, tokenizer_path, tmp_path):
    """`make(seed)`: a random small model saved as RUN/final in Hugging Face layout, on the
    session's tokenizer (its vocabulary, 64 positions, tied head)."""

    def make(seed: int = 0):
        torch.manual_seed(seed)
        cfg = ModelConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        return save_model(Llama(cfg), tmp_path / "run" / "final", tokenizer=tokenizer_path)

    return make
