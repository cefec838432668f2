"""Models made elsewhere, adapted to doel: `doel-train import` turns an existing Llama (a Hugging
Face folder or a llama.cpp GGUF) into a model folder every later stage takes as it takes a
training run's RUN/final (importing), with its own tokenizer, chat template and stop tokens; the
real model the slow tests and benchmarks use is fetched here too (smollm2)."""
