"""Benchmarks of serve's engine in one process: decode speed against llama.cpp and PyTorch, the
chat prefix cache, structured output, where a token's time goes, Bangla characters a second."""
