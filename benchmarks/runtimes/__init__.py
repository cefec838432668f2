"""Whether the runtimes people install read doel's files exactly: each module here runs one
outside tool itself (onnxruntime-genai, Go's text/template for Ollama, llama-server, ...) and
returns its rows; `bench_runtimes` gathers them into benchmarks/results/runtimes.md."""
