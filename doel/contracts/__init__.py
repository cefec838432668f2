"""What doel's stages agree on, in one place: the quantization table, the export bundle's
manifest, the OpenAI error shape, how a JSON record is read. Standard library only: every stage
imports it, and it imports no stage (tests/cross/test_imports.py), so a fact here is never
restated in a stage.
"""

from doel.contracts.errors import error_body, error_dict
from doel.contracts.jsonfile import read_json
from doel.contracts.manifest import (
    FORMAT,
    VERSION,
    KVCache,
    Manifest,
    ManifestError,
    read_manifest,
)
from doel.contracts.quant import (
    DEFAULT_GGUF,
    DEFAULT_ONNX,
    GGUF_QUANTS,
    ONNX_QUANTS,
    QUANTS,
    Quant,
    quant,
)

__all__ = [
    "DEFAULT_GGUF",
    "DEFAULT_ONNX",
    "FORMAT",
    "GGUF_QUANTS",
    "KVCache",
    "Manifest",
    "ManifestError",
    "ONNX_QUANTS",
    "QUANTS",
    "Quant",
    "VERSION",
    "error_body",
    "error_dict",
    "quant",
    "read_json",
    "read_manifest",
]
