"""doel's training stage: tokenizer, token shards, and (later) the model and its trainer."""

__version__ = "0.1.0"
