"""Build what a run trains with (`Parts`): the one place that turns a TrainConfig and a shard
folder (or sft's conversations, through a loader factory) into the objects a run uses. `fit`,
`sft`, `verify`, `check-gradients` and the recipe's step timing all call `build_parts`, so what
they check or measure is what training runs, and a run resumes one way whatever its loader.

Order: device and dtype → the shards' vocabulary against the model's → loader at this rank
(first: a loader that refuses its data does so before a model is built) → seed → model on the
device → activation checkpointing → each transformer block compiled → DDP/FSDP wrapper →
optimizer (after FSDP: on the sharded parameters) → resume from a checkpoint → the compiled
blocks warmed up.

torch.compile is regional, as torchtitan does it: each block's forward is compiled before
fully_shard (`compile_blocks`), not the wrapped model. FSDP's hooks (gathering a block's
parameters, resharding them) run around the block's module call, outside the compiled graph, so
dynamo never traces or breaks on them; the blocks are alike, so one graph serves every layer
(compile time is one block's, not 24 layers'); activation checkpointing, applied first, is
traced into it. DDP and one process take the same path for the same reasons (DDP's bucket hooks
are on the gradients, which compiled blocks produce as eager ones do) and so that a run's
compiled code does not depend on its strategy. The embedding, final norm, head and loss run
eager (the head's fp32 logits for the loss are not fused). Each block keeps its eager forward:
the compiled one runs only when called through `BlocksCompiled` (what the step calls), so the
eager module stays eager for evaluation, generation and the checks' references.

The compile is static (`dynamic=False`) and whole (`fullgraph=True`: a graph break inside a
block fails the warm-up loudly instead of splitting it silently): a call at another shape (the
parity check's small batch, the checks' smaller micro-batches) compiles a graph of its own
instead of turning the training shape's entry into a dynamic-shape graph that would then serve
every step (its speed is not the one measured). Before it, `compile_preflight` refuses in one
line a machine that lacks what inductor builds with (a C compiler, Python.h, Triton on CUDA):
without them the compile fails and an eager run is about a third slower and takes far more
memory. Any other compile failure falls back to eager with a warning.
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
import shutil
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from doel.train.checkpoint import load_checkpoint
from doel.train.common import DoelError
from doel.train.data.chat import ChatLoader
from doel.train.data.loader import TokenLoader, read_meta
from doel.train.dist import DistInfo, autocast, resolve_device, resolve_dtype, wrap_model
from doel.train.metrics import format_flops, peak_flops
from doel.train.model import Llama
from doel.train.optim import build_optimizer, describe_groups
from doel.train.settings import TrainConfig

Loader = TokenLoader | ChatLoader


@dataclass(kw_only=True)
class Parts:
    """What a run trains with. `model` is the eager module (what checkpoints, evaluation and
    the checks read), `wrapped` the DDP/FSDP module around it (or `model`), `compiled` what the
    step calls (BlocksCompiled: `wrapped` with its blocks' compiled forwards on; or `wrapped`).
    The factories make fresh copies built the same way, for checks that must step or train
    without touching the run."""

    cfg: TrainConfig
    model: nn.Module
    wrapped: nn.Module
    compiled: nn.Module
    optimizer: torch.optim.Optimizer
    # next_batch, peek, state_dict, load_state_dict (a TokenLoader, sft's ChatLoader); None
    # when the caller brings its own batches
    loader: Loader | None
    device: torch.device
    dtype: torch.dtype  # autocast dtype
    info: DistInfo
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    make_loader: Callable[[], Loader] | None
    meta: dict | None = None  # the shards' meta.json
    step: int = 0  # where a resumed run continues
    tokens_seen: int = 0
    desc: dict | None = None  # FLOPs a token, peak, world, tokens a step (when described)

    def ctx(self):
        return autocast(self.device, self.dtype)


def check_vocab(meta: dict, cfg: TrainConfig) -> None:
    """The model's embedding has a row for each token of the shards' tokenizer, no more: every
    checkpoint carries that tokenizer, and llama.cpp and the exporters require equal sizes."""
    size = meta["tokenizer"]["vocab_size"]
    if size != cfg.model.vocab_size:
        raise DoelError(
            f"the shards' tokenizer has {size} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}; they must be equal: add --set model.vocab_size={size}"
        )


# torch.compile's options for every compiled block of a run (see the module docstring).
COMPILE_OPTIONS = {"dynamic": False}
_COMPILED_ON = contextvars.ContextVar("doel_compiled_blocks", default=False)


class _EagerOrCompiled:
    """A block's forward: its compiled graph inside a BlocksCompiled call, else the eager one."""

    def __init__(self, eager: Callable, fast: Callable):
        self.eager, self.fast = eager, fast

    def __call__(self, *args, **kwargs):
        return (self.fast if _COMPILED_ON.get() else self.eager)(*args, **kwargs)


def compile_blocks(model: nn.Module) -> None:
    """Give each transformer block a compiled forward beside its eager one (traced at its first
    compiled call), before DDP/FSDP wrap the blocks: see the module docstring."""
    for block in model.model.layers:
        eager = block.forward  # the class's, or activation checkpointing's around it
        fast = torch.compile(eager, fullgraph=True, **COMPILE_OPTIONS)
        block.forward = _EagerOrCompiled(eager, fast)


class BlocksCompiled(nn.Module):
    """What the step calls under compile: the wrapped model (`_orig_mod`, as torch.compile's
    wrapper names it, so `unwrap` and parameter names treat both alike), its blocks' compiled
    forwards on for the call. Other attributes (DDP's no_sync, FSDP's gradient sync) are the
    wrapped model's."""

    def __init__(self, wrapped: nn.Module):
        super().__init__()
        self._orig_mod = wrapped

    def forward(self, *args, **kwargs):
        token = _COMPILED_ON.set(True)
        try:
            return self._orig_mod(*args, **kwargs)
        finally:
            _COMPILED_ON.reset(token)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_orig_mod":
                raise
            return getattr(self._orig_mod, name)


def compile_preflight(device: torch.device, which=None, include=None) -> str | None:
    """What torch.compile lacks on this machine to build its kernels, as the one line that
    names the package to install, or None. Inductor compiles C++ on the CPU and Triton on CUDA,
    and both build Python extensions: a C compiler and Python.h are needed either way."""
    fix = " (or set compile=false: about a third slower and more memory)"
    which = which or shutil.which
    cc = os.environ.get("CC")
    if not ((cc and which(cc)) or which("gcc") or which("cc") or which("clang")):
        return (
            "torch.compile needs a C compiler and none was found (gcc): apt-get install "
            "build-essential, or dnf install gcc gcc-c++" + fix
        )
    if device.type == "cpu" and not (which(os.environ.get("CXX") or "g++") or which("c++")):
        return "torch.compile on the CPU needs a C++ compiler (g++): apt-get install g++" + fix
    include = include or sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        ver = sysconfig.get_python_version()
        return (
            f"torch.compile needs Python.h (not in {include}): apt-get install python{ver}-dev "
            f"(or python3-devel)" + fix
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile on CUDA needs the triton package: pip install triton" + fix
    return None


def compiled(wrapped: nn.Module, batch, ctx, log) -> nn.Module:
    """`wrapped` with its compiled blocks on (BlocksCompiled; `compile_blocks` gave them before
    sharding), or, if compiling fails, `wrapped` eager with a loud warning. `batch` (inputs,
    targets on the device) warms it up; the gradients of that pass are cleared."""
    log("compiling the transformer block (one graph for every layer; the first step is slower)")
    fast = BlocksCompiled(wrapped)
    x, y = batch
    try:
        with ctx():
            fast(x, y, reduction="sum").backward()
    except Exception as e:  # noqa: BLE001 (inductor raises many kinds)
        log(f"WARNING: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eager")
        fast = wrapped
    wrapped.zero_grad(set_to_none=True)
    return fast


def describe(model, cfg: TrainConfig, device, dtype, info: DistInfo, log) -> dict:
    """Log the model's size and FLOPs a token; return what the step loop's rates need."""
    flops = model.flops_per_token(cfg.seq_len)
    peak, source = peak_flops(device, dtype)
    n = model.num_parameters()
    par = f", {info.world_size} ranks ({cfg.strategy})" if info.enabled else ""
    log(
        f"model: {n / 1e6:.2f}M parameters ({model.num_parameters(True) / 1e6:.2f}M without "
        f"the embedding); {cfg.tokens_per_step * info.world_size:,} tokens a step; device "
        f"{device}, {dtype}{par}"
    )
    log(
        f"FLOPs/token = 6·(matmul weights, head included) + 6·L·H·D·T (causal attention) = "
        f"{flops['dense'] / 1e6:.1f}M + {flops['attention'] / 1e6:.1f}M = "
        f"{flops['total'] / 1e6:.1f}M; peak {format_flops(peak)} ({source})"
    )
    return {
        "flops_per_token": flops["total"],
        "peak_flops": peak,
        "world": info.world_size,
        "tokens_per_step": cfg.tokens_per_step * info.world_size,
    }


def _tensors(batch, device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.as_tensor(a, device=device) for a in batch)


def build_parts(
    cfg: TrainConfig,
    data,
    *,
    model_factory: Callable[[TrainConfig], nn.Module] | None = None,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    loader_factory: Callable[[], Loader] | None = None,
    info: DistInfo | None = None,
    device: torch.device | None = None,
    resume_from: Path | None = None,
    compile: bool | None = None,
    example_batch=None,
    describe_to=None,
    log=print,
    checksums: bool = True,
) -> Parts:
    """Build what training `cfg` on the shards in `data` uses, resumed from `resume_from` (its
    loader too, whatever the loader). `data` None and no loader_factory: no loader (the caller
    brings its batches; `example_batch` then warms up compilation). `info`/`device`: the
    process group and device `init_distributed` gave (default: one process, cfg.device).
    `compile` overrides cfg.compile. `describe_to`: a log that gets the model's size and FLOPs.
    The factories replace the defaults (sft: its base model and ChatLoader; tests: planted
    failures): model_factory(cfg) -> model (moved to the device here), optimizer_factory(model),
    loader_factory(). `checksums`: check the shards and the checkpoint against their recorded
    hashes (--no-checksums: not)."""
    info = info or DistInfo()
    device = device or resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    meta = None
    if data is not None:
        meta = read_meta(data)
        check_vocab(meta, cfg)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def make_model() -> nn.Module:
        with torch.device(device):
            return (model_factory or (lambda c: Llama(c.model)))(cfg).to(device)

    def make_optimizer(m: nn.Module) -> torch.optim.Optimizer:
        return optimizer_factory(m) if optimizer_factory else build_optimizer(m, cfg, device)

    def make_loader() -> Loader:
        if loader_factory:
            return loader_factory()
        return TokenLoader(
            data,
            "train",
            cfg.batch_size,
            cfg.seq_len,
            cfg.seed,
            rank=info.rank,
            world_size=info.world_size,
            verify=checksums,
        )

    has_loader = data is not None or loader_factory is not None
    loader = make_loader() if has_loader else None  # data it refuses: before a model is built
    use_compile = cfg.compile if compile is None else compile
    problem = compile_preflight(device) if use_compile else None
    if problem:
        raise DoelError(problem)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = make_model()
    blocks = compile_blocks if use_compile else None
    wrapped = wrap_model(
        model, cfg.strategy, info, device, dtype, cfg.activation_checkpointing, blocks
    )
    optimizer = make_optimizer(wrapped)
    if describe_to is not None:  # the resolved groups, once at the start of a run
        for line in describe_groups(optimizer, model):
            describe_to(line)
    parts = Parts(
        cfg=cfg,
        model=model,
        wrapped=wrapped,
        compiled=wrapped,
        optimizer=optimizer,
        loader=loader,
        device=device,
        dtype=dtype,
        info=info,
        make_model=make_model,
        make_optimizer=make_optimizer,
        make_loader=make_loader if has_loader else None,
        meta=meta,
    )
    if resume_from is not None:
        _, state = load_checkpoint(resume_from, wrapped, optimizer, verify=checksums)
        loader.load_state_dict(state["loader"])
        parts.step, parts.tokens_seen = state["step"], state.get("tokens_seen", 0)
        log(f"resuming from {resume_from} (step {parts.step})")
    if describe_to is not None:
        parts.desc = describe(model, cfg, device, dtype, info, describe_to)
    if use_compile:
        batch = example_batch if loader is None else loader.peek(1)[0]
        parts.compiled = compiled(wrapped, _tensors(batch, device), parts.ctx, log)
    return parts
