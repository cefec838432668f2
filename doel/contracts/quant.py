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

    name: what `--quant` takes; for an ONNX row also the precision onnxruntime-genai's model
        builder is given (its own names).
    target: "onnx" (a bundle doel-serve runs) or "gguf" (a file llama.cpp runs).
    bits: weight bits of the linear layers; None for a float format.
    block_size: the default block of `bits`-bit weights sharing one scale (ONNX: fitted down to
        what divides the model's widths at export); GGUF: the type's fixed block, which a row
        must fill to be stored in it; None where the format has no blocks.
    head_bits: bits of the output head (and for GGUF the embedding) by default; above `bits`
        where the format keeps the head finer than the body.
    loss_bound: the held-out loss increase over fp32 (nats/token) parity allows; None: the
        format is checked against the fp32 tolerances.
    bytes_per_param: file bytes a parameter, for the recipe's disk budget.
    gguf_type: the llama.cpp type of the same bits (ONNX: the peer a benchmark compares it
        with; GGUF: the type the body's matrices are written in).
    gguf_ftype: llama.cpp's `general.file_type` (llama_ftype) for a GGUF of this format.
    promoted_bits: bits of the matrices llama.cpp's mixed formats keep finer (the QKV and down
        projections of the first and last eighth of the layers and of every third layer
        between: onnxruntime-genai's builder selector `mixed_layers`), above `bits`; None: the
        body is all `bits`.
    rounding: how the body's `bits`-bit matrices are rounded by default on builder graphs: "rtn"
        each weight to its nearest, "gptq" against calibration text (export/gptq.py).
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
    promoted_bits: int | None = None
    rounding: str = "rtn"

    @property
    def quantized(self) -> bool:
        return self.bits is not None


# Where the numbers come from (docs/kernels.md, "The format, argued from the kernels and the
# measurements", has the argument across CPU classes and which of it is measured):
# - ONNX block sizes, at accuracy level 4 (export/graph.py; level 1 ran a step 8-48x slower,
#   benchmarks/results/accuracy_level_0.4b_cpu-*.md). int4 at 256 (4.125 bits a weight, q4_0 has
#   4.5): the fastest one-row MatMulNBits on amd-avx2 (../shared/notes/avx2-profile.md, not yet a
#   committed result) and intel-avx512-amx, the fastest batched one on both AVX-512 classes
#   (benchmarks/results/profile_serve_0.4b_cpu-*.md, "MatMulNBits alone"); MLAS runs blocks
#   64-256 (AVX2) and 128-256 (AVX-512) through one kernel, so a larger block only reads fewer
#   scales (docs/kernels.md, "The table"); it raised the held-out loss less than 128 and than
#   llama.cpp's q4_0 (quant_quality_block256.md). int8 at 256: faster than 128 at every row
#   count on amd-avx2 (the note) and, end to end, on a Zen 4 amd-avx512-vnni host
#   (serve_load_0.4b_cpu-amd-avx512-vnni.md, int8-b256, and docs/kernels.md's one-row A/B of
#   issue 57), against the one-row MLP profile of an amd-avx512-vnni host of unrecorded core,
#   where 128 was faster (profile_serve_0.4b_cpu-amd-avx512-vnni.md). Each
#   block also costs ONNX Runtime's packed copy a scale and a block sum. fp32's 32 is never used
#   by the graph (no blocks); it is what export/bundle.py's table held.
# - head_bits 8 on int4: the head at 4 bits is what costs int4 most
#   (benchmarks/results/quant_quality_small.md); the speed it costs on AVX2, where 8-bit weights
#   have no one-row kernel, is argued, not measured (docs/kernels.md).
# - promoted_bits 8 on int4: on a real model (SmolLM2-135M-Instruct), rounded to nearest, int4 at
#   any block cost more held-out loss than the bound, as llama.cpp's q4_0 does, and the mixed
#   placement brought it within for a little speed; rounded with GPTQ every placement is within,
#   and the mixed one keeps the least loss at the same speed
#   (benchmarks/results/real_model_smollm2-135m_cpu-*.md, serve_smollm2-135m-gptq_cpu-*.md).
# - rounding gptq on int4: on SmolLM2-135M-Instruct it cut the held-out loss increase of either
#   placement (mixed or all 4 bits) by about half and more, and decodes as fast: the same format
#   and kernels (benchmarks/results/gptq_smollm2-135m_cpu-*.md, serve_smollm2-135m-gptq_cpu-*.md).
#   int8 stays rtn: its increase is already a tenth of its bound.
# - loss bounds: export/parity.py's, the bound an export fails past.
# - ONNX bytes_per_param: the recipe's budget (benchmarks/results/export_0.4b_cpu.md's bundles,
#   rounded up for the side files and model.ort's copy).
# - GGUF: block 32 is QK8_0 = QK4_0 in llama.cpp's ggml; bytes a parameter from the block
#   layout (q8_0: 32 int8 + one f16 scale = 34 bytes per 32; q4_0: 18 per 32, its embedding and
#   head at q8_0 on top); gguf_ftype: llama.cpp's llama_ftype (ALL_F32 0, MOSTLY_F16 1,
#   MOSTLY_Q4_0 2, MOSTLY_Q8_0 7).
QUANTS: dict[str, Quant] = {
    q.name: q
    for q in (
        Quant("fp32", "onnx", None, 32, None, None, 4.0, "f32"),
        Quant("int8", "onnx", 8, 256, 8, 0.02, 1.4, "q8_0"),
        Quant("int4", "onnx", 4, 256, 8, 0.10, 0.95, "q4_0", promoted_bits=8, rounding="gptq"),
        Quant("f32", "gguf", None, None, None, None, 4.0, "f32", 0),
        Quant("f16", "gguf", None, None, None, None, 2.0, "f16", 1),
        Quant("q8_0", "gguf", 8, 32, 8, None, 34 / 32, "q8_0", 7),
        # q4_0 keeps the embedding and the head at q8_0, as doel's int4 keeps its head at 8
        Quant("q4_0", "gguf", 4, 32, 8, None, 18 / 32, "q4_0", 2),
    )
}
ONNX_QUANTS = tuple(n for n, q in QUANTS.items() if q.target == "onnx")
GGUF_QUANTS = tuple(n for n, q in QUANTS.items() if q.target == "gguf")
DEFAULT_ONNX = "int4"
# How an ONNX format's low-bit matrices may be rounded (`doel-export --rounding`; the table's
# `rounding` column is each format's default on builder graphs).
ROUNDINGS = ("rtn", "gptq")
# The KV cache a quantized builder graph can keep (`doel-export --kv-cache`); the first is the
# default. fp16 halves the cache, int8 quarters it (export/kvcache.py says how, and cites what
# each was measured to cost).
KV_CACHES = ("fp32", "fp16", "int8")
# A graph's cache input type -> the numpy dtype name the engine allocates and the manifest's
# kv_cache.dtype records.
KV_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int8)": "int8"}
DEFAULT_GGUF = "q8_0"


def names(target: str) -> tuple[str, ...]:
    """The formats of `target` ("onnx" or "gguf"), in the table's order (read when called, so
    a row added at run time is one of them)."""
    return tuple(n for n, q in QUANTS.items() if q.target == target)


def quant(name: str, target: str | None = None) -> Quant:
    """The row for `name`; a ValueError naming the choices (of `target`, if given) otherwise."""
    row = QUANTS.get(name)
    if row is None or (target is not None and row.target != target):
        choices = names(target) if target else tuple(QUANTS)
        what = {"onnx": "an ONNX export", "gguf": "a GGUF file"}.get(target or "", "doel")
        raise ValueError(
            f"quantization {name!r} is not one {what} makes; choose from {', '.join(choices)}"
        )
    return row


def at_bits(bits: int | None, target: str) -> Quant:
    """The first row of `target` whose linear layers have `bits` bits (None: the float row)."""
    for row in QUANTS.values():
        if row.target == target and row.bits == bits:
            return row
    raise ValueError(f"no {target} quantization has {bits} bits")
