"""doel's training stage: text → tokenizer → token shards → a Llama trained and verified →
evaluation; the recipe (pipeline/) runs every stage from data to served bundles."""

__version__ = "0.1.0"
