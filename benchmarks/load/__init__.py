"""The load benchmark: doel-serve against llama-server over HTTP with many clients, and doel's
engine against onnxruntime-genai's in-process; its client, model and servers."""
