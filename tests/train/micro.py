"""The micro model the step, job and gradient-gate tests train: 2 layers of width 32 over 64 ids
and 32 positions, small enough that a step takes milliseconds. A helper module, not a fixture,
since these tests build their configs at module level."""

from __future__ import annotations

from doel.train.model import ModelConfig
from doel.train.settings import TrainConfig

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def train_config(**kw) -> TrainConfig:
    """A TrainConfig of the micro model: 16-token windows, 100 steps, `kw` over them."""
    return TrainConfig(**({"model": MODEL, "seq_len": 16, "steps": 100} | kw))
