"""`doel-export` (or `python -m doel.export`): a thin command line over `export_checkpoint`.

Heavy imports happen inside `main`, so a missing extra is reported with the `pip install` line
that fixes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from doel.contracts.checksums import add_flag
from doel.contracts.quant import (
    DEFAULT_GGUF,
    DEFAULT_ONNX,
    KV_CACHES,
    QUANTS,
    ROUNDINGS,
    names,
    quant,
)
from doel.export.common import ExportError  # standard library only, so it imports without the extra

EXTRA_HINT = "pip install 'doel[export]'"


def _listed(target: str, default: str) -> str:
    return ", ".join(f"{n} (default)" if n == default else n for n in names(target))


def _per_quant(field: str) -> str:
    """ "int8 256, int4 256": a table column's defaults for the quantized ONNX formats."""
    rows = [QUANTS[n] for n in names("onnx") if QUANTS[n].quantized]
    return ", ".join(f"{r.name} {getattr(r, field)}" for r in rows)


def _promoted() -> str:
    """ "int4 8": the formats whose table row promotes matrices, and to what."""
    rows = [QUANTS[n] for n in names("onnx") if QUANTS[n].promoted_bits]
    return ", ".join(f"{r.name} {r.promoted_bits}" for r in rows) or "none"


def build_parser() -> argparse.ArgumentParser:
    onnx_bits = sorted({QUANTS[n].bits for n in names("onnx") if QUANTS[n].quantized})
    p = argparse.ArgumentParser(
        prog="doel-export",
        description="checkpoint -> ONNX with KV cache -> int8 / int4 -> ORT format, each "
        "checked against PyTorch",
    )
    p.add_argument("checkpoint", help="model folder in Hugging Face layout (e.g. RUN/final)")
    p.add_argument("--out", required=True, help="bundle folder to write")
    p.add_argument(
        "--format",
        choices=("onnx", "gguf", "pte", "litertlm"),
        default="onnx",
        help="onnx (default): a bundle for doel-serve; gguf: DIR/model-QUANT.gguf + an Ollama "
        "Modelfile for llama.cpp, Ollama, LM Studio (needs a tokenizer llama.cpp runs id for id: "
        "`--style spm`, the default, or `--style gguf`); pte: DIR/model-QUANT.pte for ExecuTorch "
        "(XNNPACK; int4 = 8da4w, int8, fp32); litertlm: DIR/model-QUANT.litertlm for LiteRT-LM "
        "(each converter runs in its runtime's venv in ~/.cache/doel: docs/phones.md)",
    )
    p.add_argument(
        "--quant",
        choices=tuple(QUANTS),
        help=f"onnx: {_listed('onnx', DEFAULT_ONNX)}; gguf: {_listed('gguf', DEFAULT_GGUF)}",
    )
    p.add_argument("--mobile", action="store_true", help="also write model.ort (ORT Mobile)")
    p.add_argument(
        "--embeddings",
        nargs="?",
        const="mean",
        choices=("mean", "last"),
        help="also write embeddings.onnx for doel-serve's /v1/embeddings: the last hidden state, "
        "mean (the default) or last-token pooled, normalized (docs/serving.md#embeddings)",
    )
    p.add_argument(
        "--web",
        action="store_true",
        help="also write web/: a static page that runs the model in a browser: on WebAssembly "
        "with doel's own 4-bit kernel (onnxruntime-web's int8 graph where the kernel cannot run), "
        "on WebGPU with onnxruntime-web",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--block-size",
        type=int,
        help=f"weights per scale (default: {_per_quant('block_size')}, fitted)",
    )
    p.add_argument(
        "--text",
        nargs="+",
        default=[],
        help="held-out .txt/.jsonl for the loss check (default: the built-in sample)",
    )
    p.add_argument("--eval-tokens", type=int, default=4096, help="tokens scored (default 4096)")
    p.add_argument(
        "--max-loss-increase",
        type=float,
        help=f"nats/token over fp32 that fails the export (default {_per_quant('loss_bound')})",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "genai", "optimum"),
        default="auto",
        help="graph writer: auto = onnxruntime-genai's fused builder for Llama, else optimum",
    )
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHES,
        default=KV_CACHES[0],
        help=f"KV cache precision of quantized builder graphs (default {KV_CACHES[0]}): fp16 "
        "halves its memory; int8 quarters it, its scales calibrated on the --text files",
    )
    p.add_argument(
        "--head-bits",
        type=int,
        choices=onnx_bits,
        help=f"bits of the head (default {_per_quant('head_bits')}; int4 with 4: the smallest "
        "bundle, the head rounded with --rounding's method too, at more loss: docs/export.md)",
    )
    p.add_argument(
        "--promoted-bits",
        type=int,
        choices=[0, *onnx_bits[1:]],
        help="bits of the matrices llama.cpp's mixed formats keep finer (first and last eighth "
        f"of the layers, every third between: QKV and down; default {_promoted()}; 0: none, "
        "the body all of one width)",
    )
    p.add_argument(
        "--rounding",
        choices=ROUNDINGS,
        help=f"how the body's low-bit matrices are rounded (default {_per_quant('rounding')} on "
        "builder graphs, else rtn): rtn each weight to its nearest; gptq against --text past "
        "what the loss check reads (or the built-in sample), the same format (docs/export.md)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        help="pte, litertlm: positions the phone program's KV cache holds (default 2048, at most "
        "the model's context)",
    )
    p.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's)")
    p.add_argument(
        "--repo-id",
        help="the bundle's Hugging Face repository (OWNER/NAME), named in its README.md card",
    )
    add_flag(
        p,
        "export a checkpoint without checking its files against the sha256 it records "
        "(checksums.json; a damaged file is otherwise refused, named)",
    )
    p.add_argument("--json", action="store_true", help="print the manifest")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with _one_line_errors():
        if args.format == "gguf":
            _gguf(args)
        elif args.format in ("pte", "litertlm"):
            _phone(args)
        else:
            _onnx(args)


@contextlib.contextmanager
def _one_line_errors():
    """A missing extra or bad input ends the command with one line that says what to do."""
    try:
        yield
    except ModuleNotFoundError as e:
        sys.exit(
            f"doel-export needs the {e.name!r} package, part of the export extra: {EXTRA_HINT}"
        )
    except ExportError as e:
        sys.exit(f"error: {e}")


def _checked(name: str, target: str) -> str:
    """`name` if `target` (--format) makes it; else exit with the line naming its choices."""
    try:
        return quant(name, target).name
    except ValueError as e:
        sys.exit(f"error: --quant: {e} (--format {target})")


def _onnx(args) -> None:
    """--format onnx (the default): ExportOptions from the flags, then export.bundle."""
    name = _checked(args.quant or DEFAULT_ONNX, "onnx")  # before the extra's imports
    from doel.export.bundle import ExportOptions, export_checkpoint, summary

    opts = ExportOptions(
        quant=name,
        mobile=args.mobile,
        web=args.web,
        block_size=args.block_size,
        engine=args.engine,
        texts=tuple(args.text),
        max_loss_increase=args.max_loss_increase,
        eval_tokens=args.eval_tokens,
        kv_cache=args.kv_cache,
        head_bits=args.head_bits,
        promoted_bits=args.promoted_bits,
        rounding=args.rounding,
        force=args.force,
        tokenizer=args.tokenizer,
        repo_id=args.repo_id,
        verify=not args.no_checksums,
        log=lambda msg: print(msg, file=sys.stderr),
    )
    result = export_checkpoint(args.checkpoint, args.out, opts)
    if args.embeddings:
        from doel.export.embedder import add_embeddings

        result["embeddings"] = add_embeddings(args.checkpoint, args.out, args.embeddings, opts.log)
    print(json.dumps(result, indent=2) if args.json else summary(Path(args.out), result))


def _gguf(args) -> None:
    """--format gguf: the options that apply to it, then export.gguf."""
    name = _checked(args.quant or DEFAULT_GGUF, "gguf")
    from doel.export.gguf import export_gguf

    result = export_gguf(
        args.checkpoint,
        args.out,
        name,
        force=args.force,
        tokenizer=args.tokenizer,
        log=lambda msg: print(msg, file=sys.stderr),
        repo_id=args.repo_id,
        verify=not args.no_checksums,
    )
    if args.json:
        print(json.dumps(result, indent=2))


def _phone(args) -> None:
    """--format pte / litertlm: int4 (default), int8 or fp32, built in the runtime's own venv."""
    if args.format == "pte":
        from doel.export.pte import export_pte as export
    else:
        from doel.export.litertlm import export_litertlm as export
    result = export(
        args.checkpoint,
        args.out,
        args.quant or "int4",
        force=args.force,
        tokenizer=args.tokenizer,
        max_seq_len=args.max_seq_len,
        log=lambda msg: print(msg, file=sys.stderr),
        verify=not args.no_checksums,
    )
    if args.json:
        print(json.dumps(result, indent=2))
