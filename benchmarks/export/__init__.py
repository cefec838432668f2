"""Benchmarks of export: bundle size, speed and parity, quantization's cost in held-out loss, the
GGUF tokenizer and llama.cpp's parity, a phone bundle's memory."""
