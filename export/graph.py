"""Checkpoint → ONNX decoder with KV cache, quantized, plus the ORT-format copy for phones.

Two engines write the graph:
- `genai`: onnxruntime-genai's model builder. Its graph is fused (GroupQueryAttention with
  rotary, SkipSimplifiedLayerNormalization, one QKV MatMul, MatMulNBits), which decodes faster
  than the unfused graph (benchmarks/results/export_0.4b_cpu.md), so it is the default for the
  architectures in GENAI_ARCHS.
- `optimum`: optimum's `text-generation-with-past` export, quantized with ONNX Runtime's
  MatMulNBitsQuantizer. Slower, but it knows far more architectures, so it is the path for
  the rest.

Both quantize the same way, as the format's row of doel.contracts.quant says: weight-only
MatMulNBits (symmetric, one fp32 scale per block of `block_size` weights, activations quantized
to int8 per block inside the kernel, accuracy_level 4) for every linear layer including the
head; the embedding table, read one row per token, goes to 8 bits (GatherBlockQuantized,
`embedding`): it saves no decode time, but a large share of a server's memory. Quantized builder
graphs can keep their KV cache in fp16 (`--kv-cache fp16`, `kvcache`): half its memory
(benchmarks/results/phone_memory_0.4b.md), but on x86 ONNX Runtime's attention converts an fp16
cache to fp32 as it reads it, which costs batched decoding most, so fp32 is the default.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from doel.contracts.quant import KV_CACHES
from doel.contracts.quant import quant as quant_row
from doel.export import embedding, kvcache
from doel.export.checkpoint import Checkpoint
from doel.export.common import ExportError

GENAI_ARCHS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations: fastest on CPUs with VNNI
TASK = "text-generation-with-past"
LOGITS_TO_KEEP = "logits_to_keep"
# What ONNX Runtime's reduced-size build takes (build.sh --minimal_build --include_ops_by_config):
# every operator of model.ort with the types its kernels need (the tool's type reduction).
OPS_CONFIG = "required_operators_and_types.config"


def optimum_supports(ckpt: Checkpoint) -> bool:
    import optimum.exporters.onnx.model_configs  # noqa: F401  (registers the ONNX configs)
    from optimum.exporters.tasks import TasksManager

    try:
        tasks = TasksManager.get_supported_tasks_for_model_type(
            ckpt.model_type, "onnx", library_name="transformers"
        )
    except (KeyError, ValueError):
        return False
    return TASK in tasks


def choose_engine(ckpt: Checkpoint, engine: str = "auto") -> str:
    """The fused builder for the architectures it is known to handle, optimum otherwise."""
    if engine == "genai" or (engine == "auto" and ckpt.architecture in GENAI_ARCHS):
        return "genai"
    if optimum_supports(ckpt):
        return "optimum"
    raise ExportError(
        f"unsupported architecture {ckpt.architecture} (model_type {ckpt.model_type!r}): "
        f"neither onnxruntime-genai's builder (used for {sorted(GENAI_ARCHS)}) nor optimum's "
        f"'{TASK}' export knows it; export a causal language model such as LlamaForCausalLM"
    )


def quantization_info(quant: str, block_size: int, engine: str, model: Path) -> dict:
    bits = quant_row(quant, "onnx").bits
    if bits is None:
        return {"scheme": "fp32", "bits": 32, "embedding": "fp32", "lm_head": "fp32"}
    import onnx

    nbits = [
        (n.name, next(a.i for a in n.attribute if a.name == "bits"))
        for n in onnx.load(str(model), load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
    ]
    heads = [b for name, b in nbits if "lm_head" in name]
    # optimum's graphs keep the head at the body's bits; build_genai may write it finer
    finer = [b for name, b in nbits if "lm_head" not in name and b > bits]
    return {
        "scheme": f"{quant} weight-only, MatMulNBits",
        "bits": bits,
        "block_size": block_size,
        "symmetric": True,
        "accuracy_level": ACCURACY_LEVEL,
        "embedding": embedding.describe(model),
        "lm_head": f"int{heads[-1] if heads else bits} MatMulNBits",
        # the body's MatMulNBits written finer than `bits` (promoted_bits), and of how many
        "promoted": {
            "bits": max(finer, default=None),
            "matrices": len(finer),
            "of": sum(1 + ("gate_up_proj" in name) for name, _ in nbits) - len(heads),  # gate|up: 2
        },
        "quantizer": "onnxruntime-genai builder" if engine == "genai" else "MatMulNBitsQuantizer",
        # each layer's gate and up as one MatMulNBits of 2N rows and a Split (export/gate_up.py)
        "gate_up_fused": sum("gate_up_proj" in name for name, _ in nbits),
    }


@contextlib.contextmanager
def _quiet(what: str):
    """Silence the exporters' progress prints, per-node logs and tracer warnings; show the
    last of them if the exporter fails. The root logger is left as found: ONNX Runtime's
    MatMulNBits quantizer calls logging.basicConfig(level=INFO) as it is imported, which would
    print every later library's INFO lines (the GGUF writer's) in doel's output."""
    log = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log):
            with contextlib.redirect_stderr(log):
                warnings.simplefilter("ignore")
                yield
    except (ExportError, ModuleNotFoundError):  # the CLI names the extra for a missing package
        raise
    except Exception as e:
        tail = "\n".join(log.getvalue().splitlines()[-15:])
        raise ExportError(f"{what} failed: {type(e).__name__}: {e}\n{tail}") from e
    finally:
        logging.disable(logging.NOTSET)
        root.handlers[:] = handlers
        root.setLevel(level)


def build_genai(
    ckpt: Checkpoint,
    out: Path,
    quant: str,
    block_size: int,
    head_bits: int | None = None,
    promoted_bits: int | None = None,
    source: Path | None = None,
) -> Path:
    """Run onnxruntime-genai's builder (its precision names are the table's ONNX names) on
    `source` (None: the checkpoint's folder); keep model.onnx, its weights and genai_config.json.
    `head_bits` / `promoted_bits` (None: the table's; 0: none) above the body's bits keep the
    head / llama.cpp's mixed matrices finer; at or below them they are the body's."""
    row = quant_row(quant, "onnx")
    head = head_to(quant, head_bits)
    promoted = promoted_to(quant, promoted_bits)
    work, cache = out / ".genai", out / ".genai-cache"
    options = [f"block_size={block_size}", f"accuracy_level={ACCURACY_LEVEL}", "is_symmetric=1"]
    # A tied head would otherwise share one quantized matrix with the embedding, which 0.15.2
    # only implements for 4 bits (at 8 it writes a graph that does not load); kept apart, the
    # embedding stays fp32 as on untied models.
    options.append("shared_embeddings=0")
    finer = []
    if head:
        # The head finer than the body, as llama.cpp's q4_0 keeps its output matrix at 6 or 8:
        # it is where 4 bits cost most (benchmarks/results/quant_quality_small.md).
        finer.append(f"last_matmul:int{head}")
    if promoted:
        # llama.cpp's mixed placement (its Q4_K_M's): on a real model, int4 at any block is past
        # its loss bound without it (doel.contracts.quant's notes).
        finer.append(f"mixed_layers:int{promoted}")
    if finer:
        options.append(f"matmul_mixed_precision={','.join(finer)}")
    with _quiet("onnxruntime-genai's model builder"):
        from onnxruntime_genai.models import builder  # configures logging as it is imported

        args = (None, str(source or ckpt.folder), str(work), quant, "cpu", str(cache))
        extra = builder.parse_extra_options(*args, options if row.quantized else [])
        builder.create_model(*args, **extra)
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        if (work / name).exists():
            shutil.move(str(work / name), str(out / name))
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return out / "model.onnx"


def head_to(quant: str, head_bits: int | None) -> int:
    """The bits the builder keeps the head at (`head_bits`, None: the table's), or 0 where it
    takes the body's (export/gptq.py then rounds it with the body)."""
    row = quant_row(quant, "onnx")
    head = head_bits or row.head_bits
    return head if row.quantized and head and head > row.bits else 0


def promoted_to(quant: str, promoted_bits: int | None) -> int:
    """The bits the builder keeps llama.cpp's mixed matrices at (`promoted_bits`, None: the
    table's), or 0 where it keeps none finer than the body (export/gptq.py leaves those to it)."""
    row = quant_row(quant, "onnx")
    promoted = row.promoted_bits if promoted_bits is None else promoted_bits
    return promoted if row.quantized and promoted and promoted > row.bits else 0


def quantize_nbits(src: Path, dst: Path, bits: int, block_size: int) -> None:
    """Weight-only MatMulNBits quantization of every MatMul with a constant weight."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(
        onnx.load(str(src)),
        bits=bits,
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL,
    )
    q.process()
    # Files past protobuf's 2 GB limit need their weights beside them.
    big = sum(p.stat().st_size for p in src.parent.iterdir()) > 1_800_000_000
    q.model.save_model_to_file(str(dst), use_external_data_format=big)


def build_optimum(
    ckpt: Checkpoint, out: Path, quant: str, block_size: int, source: Path | None = None
) -> Path:
    """optimum's export of `source` (None: the checkpoint's folder; one merged decoder: empty
    past = prefill), then MatMulNBits."""
    from optimum.exporters.onnx import main_export

    work = out / ".optimum"
    with _quiet("optimum's ONNX export"):
        folder = str(source or ckpt.folder)
        main_export(folder, str(work), task=TASK, do_validation=False, device="cpu")
        bits = quant_row(quant, "onnx").bits
        if bits:
            quantize_nbits(work / "model.onnx", out / "model.onnx", bits, block_size)
        else:
            for p in work.iterdir():
                if p.name.startswith("model.onnx"):
                    shutil.move(str(p), str(out / p.name))
    shutil.rmtree(work, ignore_errors=True)
    return out / "model.onnx"


def add_logits_to_keep(model: Path) -> bool:
    """Give the head an input `logits_to_keep` ([1] int64, default 0): the head then computes
    the logits of the last k positions only, 0 meaning all of them (the default: the parity
    checks and onnxruntime-genai get the graph's usual output). A server needs only the last
    position's; without this, a 1,536-token prompt of the 0.4B model (vocabulary 32,768) makes
    the head do 1,536 times the work and return [1, 1536, 32768] fp32 logits, 201 MB. The input
    is an initializer listed among the graph's inputs, which ONNX Runtime lets a caller
    override. Returns False, leaving the graph alone, when `logits` is not made by one MatMul
    over [batch, sequence, hidden]."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load(str(model), load_external_data=False)  # the weights stay where they are
    g = m.graph
    heads = [n for n in g.node if "logits" in n.output]
    if len(heads) != 1 or heads[0].op_type not in ("MatMul", "MatMulNBits"):
        return False
    head, k = heads[0], LOGITS_TO_KEEP
    g.input.append(helper.make_tensor_value_info(k, TensorProto.INT64, [1]))
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([0], np.int64), k),
            numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), f"{k}/end"),
            numpy_helper.from_array(np.array([1], np.int64), f"{k}/axis"),
        ]
    )
    # Slice(hidden, -k, end, axis 1): k = 0 starts at 0, the whole sequence.
    neg = helper.make_node("Neg", [k], [f"{k}/start"], name=f"/{k}/Neg")
    cut = [head.input[0], f"{k}/start", f"{k}/end", f"{k}/axis"]
    sl = helper.make_node("Slice", cut, [f"{k}/hidden"], name=f"/{k}/Slice")
    head.input[0] = f"{k}/hidden"
    at = list(g.node).index(head)
    g.node.insert(at, sl)
    g.node.insert(at, neg)
    onnx.save(m, str(model))
    return True


def build_graph(
    ckpt: Checkpoint,
    out: Path,
    quant: str,
    block_size: int,
    engine: str,
    kv_cache: str = KV_CACHES[0],
    head_bits: int | None = None,
    promoted_bits: int | None = None,
    calibration=(),
    source: Path | None = None,
) -> Path:
    """The graph in `out`; `head_bits`, `promoted_bits` and `kv_cache` (fp16 or int8, whose
    scales come from running the `calibration` docs of token ids) apply to builder graphs
    (optimum's keep every matrix at the body's bits; the manifest reports what was written)."""
    try:
        row = quant_row(quant, "onnx")
    except ValueError as e:
        raise ExportError(f"--quant: {e}") from None
    if engine == "genai":
        model = build_genai(ckpt, out, quant, block_size, head_bits, promoted_bits, source)
    else:
        model = build_optimum(ckpt, out, quant, block_size, source)
    add_logits_to_keep(model)
    if row.quantized:
        from doel.export import gate_up

        if engine == "genai" and gate_up.enabled():  # DOEL_EXPORT_GATE_UP=0 turns it off
            gate_up.fuse_model_file(model)
        if engine == "genai" and kv_cache == "fp16":
            kvcache.half_kv_cache(model)
        embedding.quantize_embedding(model, block_size)  # it rewrites the weights file
        if engine == "genai" and kv_cache == "int8":  # last: the scales run the graph so far
            peak = kvcache.calibrate(model, ckpt.kv_heads, ckpt.head_dim, calibration)
            kvcache.int8_kv_cache(model, peak)
    return model


def convert_to_ort(model: Path, out: Path) -> Path:
    """The ORT-format model that ONNX Runtime Mobile loads (optimizations fixed at conversion,
    ARM kernels' layouts: the same file serves Android and iOS), and beside it OPS_CONFIG."""
    work = out / ".ort"
    cmd = [sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(model)]
    cmd += ["--output_dir", str(work), "--optimization_style", "Fixed", "--target_platform", "arm"]
    cmd += ["--enable_type_reduction"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    made = work / (model.stem + ".ort")
    configs = list(work.glob("*.required_operators_and_types.config"))
    if proc.returncode != 0 or not made.is_file() or len(configs) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise ExportError(f"ORT-format conversion failed (exit {proc.returncode}):\n{tail}")
    shutil.move(str(made), str(out / made.name))
    # The tool heads the config with the path of the model it read, a folder of this machine's
    # (the manifest names none): the bundle's file names its model.
    lines = configs[0].read_text(encoding="utf-8").splitlines()
    ops = [line for line in lines if line.strip() and not line.startswith("#")]
    head = [f"# Operators and types of {made.name}: ONNX Runtime's --include_ops_by_config"]
    (out / OPS_CONFIG).write_text("\n".join(head + ops) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    return out / made.name
