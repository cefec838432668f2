"""The one quantization table: every format doel exports, with what each step needs to know.

The export command line, `ExportOptions`, the graph builder, parity, the manifest, the GGUF
writer, the web export and the recipe (its spec and its budget) all read a row of this table,
so adding a format means a row here and the code that builds it, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quant:
    """One way to store the weights.

    target: "onnx" (a bundle doel-serve runs) or "gguf" (a file llama.cpp runs).
    bits: weight bits of the linear layers; None for a float format.
    block_size: the default block of `bits`-bit weights sharing one scale (fitted down to what
        divides the model's widths at export); None where the format has no choice.
    head_bits: bits of the output head by default (int4 bundles keep it at 8: the head is where
        4 bits cost most, benchmarks/results/quant_quality_small.md).
    loss_bound: the held-out loss increase over fp32 (nats/token) parity allows; None: the
        format is checked against the fp32 tolerances.
    bytes_per_param: bundle bytes a parameter, for the recipe's disk budget (measured:
        benchmarks/results/export_0.4b_cpu.md, gguf.md).
    gguf_type: the llama.cpp type of the same bits (the peer a benchmark compares it with).
    gguf_ftype: llama.cpp's `general.file_type` for a GGUF of this format.
    """

    name: str
    target: str
    bits: int | None
    block_size: int | None
    head_bits: int | None
    loss_bound: float | None
    bytes_per_param: float
    gguf_type: str | None
    gguf_ftype: int | None = None

    @property
    def quantized(self) -> bool:
        return self.bits is not None


QUANTS: dict[str, Quant] = {
    q.name: q
    for q in (
        Quant("fp32", "onnx", None, 32, None, None, 4.0, "f32"),
        Quant("int8", "onnx", 8, 128, 8, 0.02, 1.4, "q8_0"),
        Quant("int4", "onnx", 4, 256, 8, 0.10, 0.95, "q4_0"),
        Quant("f32", "gguf", None, None, None, None, 4.0, "f32", 0),
        Quant("f16", "gguf", None, None, None, None, 2.0, "f16", 1),
        Quant("q8_0", "gguf", 8, 32, 8, None, 1.07, "q8_0", 7),
        # q4_0 keeps the embedding and the head at q8_0, as doel's int4 keeps its head at 8
        Quant("q4_0", "gguf", 4, 32, 8, None, 0.6, "q4_0", 2),
    )
}
ONNX_QUANTS = tuple(n for n, q in QUANTS.items() if q.target == "onnx")
GGUF_QUANTS = tuple(n for n, q in QUANTS.items() if q.target == "gguf")
DEFAULT_ONNX = "int4"
DEFAULT_GGUF = "q8_0"


def quant(name: str, target: str | None = None) -> Quant:
    """The row for `name`; a ValueError naming the choices (of `target`, if given) otherwise."""
    row = QUANTS.get(name)
    if row is None or (target is not None and row.target != target):
        choices = ONNX_QUANTS if target == "onnx" else GGUF_QUANTS if target == "gguf" else QUANTS
        where = f"an {target.upper()} export" if target == "onnx" else f"a {target.upper()} file"
        what = where if target else "doel"
        raise ValueError(
            f"quantization {name!r} is not one {what} makes; choose from {', '.join(choices)}"
        )
    return row
