"""Benchmarks of training: the tokenizer, the training loop against a plain one, the optimizer,
a GPU's throughput, data-parallel scaling, evaluation."""
