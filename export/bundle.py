"""`export_checkpoint`: checkpoint folder → a self-contained bundle that serving runs without torch:

    BUNDLE/model.onnx (+ model.onnx.data)   the decoder with KV cache
    BUNDLE/model.ort                        with --mobile: the same graph for ONNX Runtime Mobile
    BUNDLE/required_operators_and_types.config  with --mobile: its operators and types, what a
                                            reduced-size ONNX Runtime build takes
    BUNDLE/tokenizer.json                   the checkpoint's tokenizer, unchanged
    BUNDLE/config.json                      the checkpoint's, unchanged; with the next three, what
    BUNDLE/tokenizer_config.json            transformers' AutoTokenizer and optimum's
    BUNDLE/special_tokens_map.json          ORTModelForCausalLM read (hf_files)
    BUNDLE/generation_config.json
    BUNDLE/genai_config.json                (builder engine) lets onnxruntime-genai run it too
    BUNDLE/tokenizer_module.json            (spm tokenizers) what onnxruntime-genai's own
                                            tokenizer needs to give tokenizers' ids (genai)
    BUNDLE/README.md                        the model card: the folder is a Hub model repo as it
                                            is (card)
    BUNDLE/manifest.json                    I/O names and shapes, vocabulary, special ids, context
                                            length, quantization, sha256 of every file, the
                                            source config's hash and the parity figures
    BUNDLE/web/                             with --web: a static page that runs the model in a
                                            browser, and the weights in hashed pieces (web)

Everything is written into a hidden folder beside BUNDLE and renamed at the end, after every check
passed, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import numpy as np

from doel.contracts import read_json
from doel.contracts.manifest import KVCache, Manifest
from doel.contracts.quant import DEFAULT_ONNX, KV_CACHES, QUANTS, ROUNDINGS, names, quant
from doel.export import card, genai, gptq, graph, parity, web
from doel.export.checkpoint import Checkpoint, inspect_checkpoint, source_record
from doel.export.common import ExportError, file_table, staging, write_json
from doel.export.runner import OnnxLM

BLOCK_SIZES = (16, 32, 64, 128, 256)  # what MatMulNBits implements
MAX_WINDOW = 512  # tokens per forward when measuring the loss


@dataclass(frozen=True)
class ExportOptions:
    quant: str = DEFAULT_ONNX  # a row of doel.contracts.quant.QUANTS whose target is onnx
    mobile: bool = False
    block_size: int | None = None  # None: the table's block_size fitted to the model (fit_block)
    engine: str = "auto"
    texts: tuple[str, ...] = ()
    max_loss_increase: float | None = None  # nats/token; None: the default bound per quant
    eval_tokens: int = 4096
    kv_cache: str = KV_CACHES[0]  # fp16 / int8: half / a quarter of the cache (builder graphs)
    head_bits: int | None = None  # the head (builder graphs); None: the table's head_bits
    promoted_bits: int | None = None  # llama.cpp's mixed matrices (builder graphs); None: the
    # table's promoted_bits, 0: none (a body all of one width)
    force: bool = False
    tokenizer: str | None = None
    repo_id: str | None = None  # the bundle's Hub repository, for its card
    web: bool = False  # also BUNDLE/web: the static page that runs it in a browser
    verify: bool = True  # check the checkpoint's files against its checksums.json, if it has one
    rounding: str | None = None  # rtn / gptq: the body's low-bit matrices rounded alone / against
    # text past the loss check's (export/gptq.py); None: the table's on builder graphs, where
    # text is left for it, else rtn
    log: object = field(default=print, compare=False)

    def __post_init__(self):
        try:
            quant(self.quant, "onnx")
        except ValueError as e:
            raise ExportError(f"--quant: {e}") from None
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise ExportError(f"--block-size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.engine not in ("auto", "genai", "optimum"):
            raise ExportError(f"--engine must be auto, genai or optimum, got {self.engine!r}")
        heads = head_choices()
        if self.head_bits is not None and self.head_bits not in heads:
            raise ExportError(
                f"--head-bits must be {' or '.join(map(str, heads))}, got {self.head_bits}"
            )
        if self.promoted_bits not in (None, 0, *heads):
            choices = " or ".join(map(str, (0, *heads)))
            raise ExportError(f"--promoted-bits must be {choices}, got {self.promoted_bits}")
        if self.kv_cache not in KV_CACHES:
            raise ExportError(f"--kv-cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.kv_cache == "int8" and self.web:  # its attention kernel is ONNX Runtime's CPU one
            raise ExportError(
                "--web with --kv-cache int8: onnxruntime-web's attention was not checked with an "
                "int8 cache; export the page with --kv-cache fp32 or fp16"
            )
        if self.rounding not in (None, *ROUNDINGS):
            raise ExportError(f"--rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "gptq" and not quant(self.quant, "onnx").quantized:
            raise ExportError(
                f"--rounding gptq rounds quantized matrices; --quant {self.quant} has none"
            )
        if self.eval_tokens < 16:
            raise ExportError(f"--eval-tokens must be at least 16, got {self.eval_tokens}")
        if self.repo_id is not None:
            card.check_repo_id(self.repo_id)


def head_choices() -> tuple[int, ...]:
    """The bits a head may take: those of the quantized ONNX formats (MatMulNBits' widths)."""
    return tuple(sorted({QUANTS[n].bits for n in names("onnx") if QUANTS[n].quantized}))


def fit_block(name: str, widths: tuple[int, ...]) -> int:
    """The table's block_size for `name`, halved until it divides every linear layer's input
    width: a block that runs past the end of a row is padded with zeros that are stored and
    multiplied for nothing (the small preset's 384 takes 128; the 0.4B's 1,024 and 3,584 take
    256)."""
    block = quant(name, "onnx").block_size
    while block > BLOCK_SIZES[0] and any(w % block for w in widths):
        block //= 2
    return block


def linear_widths(config: dict) -> tuple[int, ...]:
    """The input widths of a model's linear layers: hidden and MLP sizes, by their Llama names
    or GPT-2's (an architecture the builder does not know goes through optimum)."""
    hidden = config.get("hidden_size") or config.get("n_embd")
    inner = config.get("intermediate_size") or config.get("n_inner") or 4 * (hidden or 0)
    return tuple(w for w in (hidden, inner) if isinstance(w, int) and w > 0)


def io_table(lm: OnnxLM) -> dict:
    def rows(args):
        return [{"name": a.name, "shape": list(a.shape), "dtype": a.type} for a in args]

    return {
        "inputs": rows(lm.session.get_inputs()),
        # Inputs with a default that a caller may override (logits_to_keep).
        "optional_inputs": rows(lm.session.get_overridable_initializers()),
        "outputs": rows(lm.session.get_outputs()),
    }


def versions() -> dict:
    names = ("onnx", "onnxruntime", "onnxruntime-genai", "optimum-onnx", "transformers", "torch")
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def prove(
    ckpt: Checkpoint, opts: ExportOptions, model: Path, texts: list[dict]
) -> tuple[dict, OnnxLM]:
    """Parity figures of the graph `model`; raises ExportError when one is past its bound."""
    lm = OnnxLM(model, ckpt.kv_heads, ckpt.head_dim)
    ref_logits = parity.torch_reference(ckpt)
    prompts = parity.prompt_ids(ckpt)
    window = min(ckpt.context_length, MAX_WINDOW)
    figures = {
        "definition": "max |onnx - reference| / max |reference| over all logits of the prompts",
        "prompts": len(prompts),
        "prompt_tokens": int(sum(p.shape[1] for p in prompts)),
        "logits_vs_torch": parity.logits_parity(lm, ref_logits, prompts),
        "kv_cache_vs_full": parity.kv_parity(lm, prompts),
        "loss": parity.loss_increase(lm, ref_logits, texts, window),
    }
    quantized = quant(opts.quant).quantized
    figures["logits_vs_torch"]["bound"] = None if quantized else parity.LOGITS_BOUND
    parity.check(figures, opts.quant, opts.max_loss_increase)
    return figures, lm


def manifest(
    ckpt: Checkpoint, opts: ExportOptions, engine: str, lm: OnnxLM, model: Path, **extra
) -> Manifest:
    kv = KVCache(
        layers=len(lm.past_names) // 2,
        kv_heads=ckpt.kv_heads,
        head_dim=ckpt.head_dim,
        dtype=np.dtype(lm.kv_dtype).name,  # float16 / int8 from --kv-cache
        position_ids_input="position_ids" in lm.input_names,
        # GroupQueryAttention writes the new entries in place, so one preallocated buffer can
        # be bound as both past and present (much faster at long context).
        past_present_share_buffer=engine == "genai",
        layout="[batch, kv_heads, sequence, head_dim], past_key_values.{i}.key/.value in, "
        "present.{i}.key/.value out",
    )
    return Manifest(
        kind="onnx",
        model="model.onnx",
        quant=opts.quant,
        vocab_size=ckpt.vocab_size,
        context_length=ckpt.context_length,
        kv_cache=kv,
        special_tokens=ckpt.special_tokens,
        extra={
            "mobile_model": "model.ort" if opts.mobile else None,
            "mobile_ops_config": graph.OPS_CONFIG if opts.mobile else None,
            "engine": engine,
            "architecture": ckpt.architecture,
            **io_table(lm),
            "tokenizer_vocab_size": ckpt.tokenizer_vocab_size,
            "quantization": {
                **graph.quantization_info(opts.quant, opts.block_size, engine, model),
                "rounding": opts.rounding,
            },
            "source": source_record(ckpt),
            "versions": versions(),
            **extra,
        },
    )


def hf_files(ckpt: Checkpoint, stage: Path, log=print) -> None:
    """config.json and the tokenizer's and generation's side files, so that the bundle loads in
    transformers' AutoTokenizer and optimum's ORTModelForCausalLM as it is. Taken from the
    checkpoint (and the tokenizer's folder) where they are, completed where they are not: a
    checkpoint written before doel added model_input_names, or without side files at all.

    The model's own chat format goes with it (export/chat.py): its chat template into
    tokenizer_config.json (where doel-serve, transformers and genai's apply_chat_template read
    it, from a chat_template.jinja too), its EOS as config.json names it (a folder transformers
    rebuilt from a GGUF names <|im_start|> in tokenizer_config.json; doel-serve stops a chat
    reply at that file's eos_token). generation_config.json stays the model's own."""
    shutil.copyfile(ckpt.folder / "config.json", stage / "config.json")
    specials = {
        f"{role}_token": ckpt.special_tokens[role]["token"]
        for role in ("bos", "eos", "pad")
        if role in ckpt.special_tokens
    }
    tok_config = read_json(ckpt.tokenizer.parent / "tokenizer_config.json") or dict(specials)
    # Without a class AutoTokenizer falls back to the config's model type (a Llama tokenizer,
    # which adds a <s> of its own); the plain fast class encodes exactly as tokenizer.json does.
    tok_config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    # Without it transformers 4.x returns token_type_ids, which generate() refuses.
    tok_config.setdefault("model_input_names", ["input_ids", "attention_mask"])
    if ckpt.chat_template is not None and not tok_config.get("chat_template"):
        tok_config["chat_template"] = ckpt.chat_template
    special_map = read_json(ckpt.tokenizer.parent / "special_tokens_map.json") or specials
    eos = specials.get("eos_token")
    records = {"tokenizer_config.json": tok_config, "special_tokens_map.json": special_map}
    for name, record in records.items():
        said = record.get("eos_token")
        said = said.get("content") if isinstance(said, dict) else said
        if eos is not None and said not in (None, eos):
            log(f"note: {name} names {said} as EOS, config.json {eos}: the bundle's says {eos}")
            record["eos_token"] = eos
    write_json(stage / "tokenizer_config.json", tok_config)
    write_json(stage / "special_tokens_map.json", special_map)
    gen = read_json(ckpt.folder / "generation_config.json") or {
        f"{role}_token_id": ckpt.special_tokens[role]["id"]
        for role in ("bos", "eos", "pad")
        if role in ckpt.special_tokens
    }
    # Older checkpoints set max_length: a plain generate() then runs to the end of the context,
    # and some transformers versions warn when max_new_tokens is given beside it.
    gen.pop("max_length", None)
    write_json(stage / "generation_config.json", gen)


def export_checkpoint(checkpoint: str | Path, out: str | Path, opts: ExportOptions) -> dict:
    """Export, prove, write the bundle; return its manifest. Raises ExportError on bad input or a
    failed check, leaving `out` untouched."""
    log, out = opts.log, Path(out)
    ckpt = inspect_checkpoint(checkpoint, opts.tokenizer, verify=opts.verify)
    if opts.block_size is None:
        opts = replace(opts, block_size=fit_block(opts.quant, linear_widths(ckpt.config)))
    engine = graph.choose_engine(ckpt, opts.engine)
    default = quant(opts.quant, "onnx").rounding
    maybe = opts.rounding == "gptq" or (opts.rounding is None and default == "gptq")
    rest = gptq.CALIBRATION_TOKENS if maybe else 0
    texts = parity.eval_texts(ckpt, opts.texts, opts.eval_tokens, rest)  # bad --text fails early
    window = min(ckpt.context_length, MAX_WINDOW)
    calibration = gptq.calibration_files(ckpt, texts, window) if maybe else []
    chosen = gptq.choose_rounding(opts.rounding, opts.quant, engine, bool(calibration), log)
    opts = replace(opts, rounding=chosen)
    if opts.web:
        web.runtime_modules(log)  # no npm, no page: said before the export's minutes, not after
    t0 = time.perf_counter()
    with staging(out, opts.force) as stage:
        source = None
        if opts.rounding == "gptq":  # the builder's mixed matrices are left to it
            builder = engine == "genai"  # optimum's graphs quantize every matrix at one width
            finer = builder and bool(graph.promoted_to(opts.quant, opts.promoted_bits))
            head = not (builder and graph.head_to(opts.quant, opts.head_bits))
            args = (quant(opts.quant, "onnx").bits, opts.block_size, finer, calibration, log)
            source = gptq.rounded_checkpoint(ckpt, stage / ".gptq", *args, head=head)
        log(f"building the {opts.quant} graph of {ckpt.architecture} with the {engine} engine")
        model = graph.build_graph(
            ckpt,
            stage,
            opts.quant,
            opts.block_size,
            engine,
            kv_cache=opts.kv_cache,
            # the held-out text the loss is measured on (the scales are 2 numbers a channel)
            calibration=[d[:window] for t in texts for d in t["docs"]],
            head_bits=opts.head_bits,
            promoted_bits=opts.promoted_bits,
            source=source,
        )
        if source is not None:
            shutil.rmtree(source)
        build_s = time.perf_counter() - t0
        shutil.copyfile(ckpt.tokenizer, stage / "tokenizer.json")
        hf_files(ckpt, stage, log)
        genai_tok = genai.write_genai_files(read_json(ckpt.tokenizer) or {}, stage, log)
        log("checking parity against PyTorch")
        figures, lm = prove(ckpt, opts, model, texts)
        if opts.mobile:
            log("converting to ORT format for ONNX Runtime Mobile")
            ort_model = graph.convert_to_ort(model, stage)
            ort_lm = OnnxLM(ort_model, ckpt.kv_heads, ckpt.head_dim)
            figures["ort_format_vs_onnx"] = parity.ort_parity(lm, ort_lm, parity.prompt_ids(ckpt))
        timing = {"build_s": build_s, "total_s": time.perf_counter() - t0}
        result = manifest(
            ckpt, opts, engine, lm, model, parity=figures, timing=timing, genai_tokenizer=genai_tok
        ).to_dict()
        card.write_card(stage, result, out.resolve().name, ckpt.folder, opts.repo_id)
        if opts.web:
            log("writing the browser page into web/ (onnxruntime-web)")
            page = web.write_web(
                stage, stage / "web", log, manifest=result, name=out.resolve().name
            )
            result["web"] = {
                "folder": "web",
                "bytes": page["bytes"],
                "pieces": len(page["data"]),
                "runtime": page["runtime"],
            }
        result["files"] = file_table(stage)  # manifest.json itself is the one file not listed
        # Through the reader: a bundle whose manifest serve would refuse is never written.
        write_json(stage / "manifest.json", Manifest.from_dict(result).to_dict())
    return result


def bundle_bytes(manifest: dict) -> int:
    return sum(f["bytes"] for f in manifest["files"].values())


def _against(value: float, bound: float | None, fmt: str, unit: str = "") -> str:
    """A figure's bound and whether it holds: a bare "max rel err 3.04e-01" tells a reader
    nothing."""
    if bound is None:
        return ""
    return f" (bound {bound:{fmt}}{unit}: {'ok' if value <= bound else 'over'})"


def summary(out: Path, m: dict) -> str:
    """A few lines for people: where, how big, how close, each figure against its bound."""
    p, loss = m["parity"], m["parity"]["loss"]
    logits, kv = p["logits_vs_torch"], p["kv_cache_vs_full"]
    scheme = m["quantization"]["scheme"]
    lines = [
        f"wrote {out} ({bundle_bytes(m) / 1e6:.1f} MB, {scheme}, "
        f"{m['engine']} engine, {m['timing']['total_s']:.1f} s)",
        f"  logits vs PyTorch: max rel err {logits['max_rel_err']:.2e}"
        + _against(logits["max_rel_err"], logits.get("bound"), ".0e")
        + f", top-1 agreement {logits['top1_agreement']:.3f}"
        # Quantized weights move every logit by design: the loss increase below is the test.
        + ("" if logits.get("bound") is not None else " (quantized: no bound, see the loss)"),
        f"  KV-cache path vs full forward: max rel err {kv['max_rel_err']:.2e}"
        + _against(kv["max_rel_err"], kv.get("bound"), ".1e"),
        f"  held-out loss increase: {loss['increase_nats_per_token']:+.4f} nats/token"
        + _against(loss["increase_nats_per_token"], loss.get("bound_nats_per_token"), "g")
        + f", {loss['increase_bits_per_char']:+.4f} bits/char over {loss['tokens']} tokens",
    ]
    if "web" in m:
        lines.append(
            f"  browser page: {out / 'web'} ({m['web']['bytes'] / 1e6:.1f} MB); try it with "
            f"python -m doel.export.web serve {out / 'web'}"
        )
    if "ort_format_vs_onnx" in p:
        ort = p["ort_format_vs_onnx"]
        lines.append(
            f"  ORT format vs ONNX: max rel err {ort['max_rel_err']:.2e}"
            + _against(ort["max_rel_err"], ort.get("bound"), ".0e")
        )
    return "\n".join(lines)
