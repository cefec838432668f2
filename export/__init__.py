"""doel's export stage: a Hugging Face checkpoint folder -> an ONNX bundle (decoder with KV cache,
fp32 / int8 / int4, ORT format for phones) that serving runs without torch, proven against
PyTorch. Entry point: `doel-export` (export/cli.py); the work: `export.bundle.export_checkpoint`.
"""
