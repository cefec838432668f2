"""Calibrated rounding (`--rounding gptq`): a checkpoint's low-bit matrices rounded against text.

Round-to-nearest, MatMulNBits' own quantizer, rounds each weight alone. GPTQ (Frantar et al.
2022, arXiv:2210.17323) rounds one input column at a time and moves its rounding error onto the
columns not yet rounded, as the layer's inputs co-vary on calibration text (H = XᵀX), so that the
layer's output rather than its weights stays close. The rule here is that the result is still
an ordinary bundle:
- the grid is MatMulNBits' symmetric one: one scale a block of `block` inputs, the block's
  largest-magnitude weight over -2^(bits-1), and that weight kept at -2^(bits-1). The builder's
  round-to-nearest, run on the rounded weights, finds the same scales and integers
  (tests/export/test_gptq.py), so the graph is the one `rtn` writes with other numbers in it;
- scales are fixed before rounding (static groups) and columns are taken in the order of H's
  diagonal, largest first (act-order), the two that keep the format and cost nothing at decode;
- each token's input counts once (scaled to unit length): otherwise the first token of a
  window, whose activations are hundreds of times the rest, decides every layer's rounding;
- each text file's H counts alike, so Bangla and English weigh the same whatever their tokens;
- one pass of the unrounded model gives every layer's H, and the text is what the loss check
  does not read (parity.eval_texts' `rest`), so the check stays held out;
- a head at the body's bits (`--head-bits 4` on int4) is rounded too, against the decoder's
  output; a tied head is untied first, so that the embedding keeps its own weights.
The measurements behind each choice: benchmarks/results/gptq_smollm2-135m_cpu-*.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from doel.contracts.quant import quant
from doel.export import parity
from doel.export.checkpoint import Checkpoint
from doel.export.common import ExportError

DAMP = 0.01  # of H's mean diagonal, added to it: H stays invertible where text is thin
COLUMNS = 128  # columns rounded between two updates of the rest (the algorithm's lazy batch)
CALIBRATION_TOKENS = 16384  # read past the loss check's text, over all files
NO_TEXT = (
    "--rounding gptq: no text is left past what the loss check reads; pass --text files longer "
    "than --eval-tokens, or --rounding rtn"
)
ATTN = ("q_proj", "k_proj", "v_proj")
HEAD = "lm_head"  # its input is the decoder's output, not a hooked module's input
MLP_IN = ("gate_proj", "up_proj")


def calibration_files(ckpt: Checkpoint, texts: list[dict], window: int) -> list[list]:
    """Text the loss check does not read (`texts` from parity.eval_texts with a `rest`), per
    file in windows of `window` token ids: its files past the part it reads, or where that is
    none, the built-in sample, unless the check read that."""
    rest = [t["rest"] for t in texts if t.get("rest")]
    if not rest:
        sample = parity.eval_texts(ckpt, [], 0, CALIBRATION_TOKENS)
        if not {t["sha256"] for t in texts} & {t["sha256"] for t in sample}:
            rest = [t["rest"] for t in sample if t["rest"]]
    return [[d[i : i + window] for d in f for i in range(0, len(d) - 1, window)] for f in rest]


def choose_rounding(asked: str | None, quant_name: str, engine: str, has_text: bool, log) -> str:
    """--rounding as `asked` (gptq with no text to calibrate on is an error), else the table's
    on builder graphs (their module names are Llama's) where there is text, else rtn."""
    row = quant(quant_name, "onnx")
    if asked == "gptq" and not has_text:
        raise ExportError(NO_TEXT)
    if asked is not None:
        return asked
    if row.quantized and row.rounding == "gptq" and engine == "genai" and has_text:
        return "gptq"
    if row.quantized and row.rounding == "gptq":
        why = "not a builder graph" if engine != "genai" else "no text past the loss check's"
        log(f"rounding {quant_name} to nearest: {why}")
    return "rtn"


def promoted_layers(n_layers: int) -> set[int]:
    """The layers whose QKV and down matrices the builder's `mixed_layers` keeps finer
    (onnxruntime-genai's placement, taken from llama.cpp's): they are rounded by it, not here."""
    return {
        i
        for i in range(n_layers)
        if i < n_layers / 8 or i >= 7 * n_layers / 8 or (i - round(n_layers / 8)) % 3 == 2
    }


def targets(n_layers: int, promoted: set[int]) -> dict[str, str]:
    """{module name: the module whose input it shares (its H)} for every matrix rounded here."""
    out = {}
    for i in range(n_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        names = [f"{attn}.o_proj", *(f"{mlp}.{p}" for p in MLP_IN)]
        if i not in promoted:
            names += [f"{attn}.{p}" for p in ATTN] + [f"{mlp}.down_proj"]
        for name in names:
            last = name.rsplit(".", 1)[1]
            share = "q_proj" if last in ATTN else "gate_proj" if last in MLP_IN else last
            out[name] = f"{name.rsplit('.', 1)[0]}.{share}"
    return out


def hessians(model, files: list[list[list[int]]], names: set[str]) -> dict:
    """{module name: H} over each file's windows of token ids: the mean of x xᵀ / |x|² over a
    file's tokens, averaged over the files."""
    import torch

    modules = dict(model.named_modules())
    body = model.get_decoder()  # the matrices' inputs and the head's, without its logits
    missing = sorted(n for n in names if n not in modules)
    if missing:
        raise ExportError(f"--rounding gptq: the model has no {missing[0]}; use --rounding rtn")
    total: dict = {}
    for windows in files:
        sums: dict = {}
        counts: dict = {}
        hooks = {n: body if n == HEAD else modules[n] for n in names}
        handles = [m.register_forward_hook(_accumulate(n, sums, counts)) for n, m in hooks.items()]
        try:
            with torch.no_grad():
                for ids in windows:
                    body(torch.tensor([ids]))
        finally:
            for h in handles:
                h.remove()
        for name in names:
            total[name] = total.get(name, 0) + sums[name] / counts[name] / len(files)
    return total


def _accumulate(name: str, sums: dict, counts: dict):
    """A forward hook adding x xᵀ / |x|² of each token's input to `sums[name]` (the head's
    input: the decoder's output)."""

    def add(_module, inputs, output):
        x = output[0] if name == HEAD else inputs[0]  # the head's: the decoder's output
        x = x.detach().reshape(-1, x.shape[-1]).double()
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        sums[name] = sums.get(name, 0) + x.T @ x
        counts[name] = counts.get(name, 0) + x.shape[0]

    return add


def round_matrix(weight, h, bits: int, block: int, damp: float = DAMP):
    """`weight` [out, in] rounded onto MatMulNBits' symmetric grid of `bits` and `block`
    against `h` [in, in]; returns the dequantized weights (float32), on the grid exactly."""
    import torch

    w = weight.detach().double().clone()
    rows, cols = w.shape
    if cols % block:
        raise ExportError(f"--rounding gptq: {cols} inputs are not a multiple of block {block}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    groups = w.reshape(rows, cols // block, block)
    pin = groups.abs().argmax(-1)  # [rows, groups]: the weight the scale is taken from
    scale = torch.gather(groups, -1, pin[..., None]).squeeze(-1) / lo
    scale[scale == 0] = 1.0
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(cols, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for a in range(0, cols, COLUMNS):
        b = min(a + COLUMNS, cols)
        part, err = w[:, a:b].clone(), torch.zeros(rows, b - a, dtype=w.dtype)
        for j in range(b - a):
            col = int(order[a + j])
            g, s = col // block, scale[:, col // block]
            q = torch.clamp(torch.round(part[:, j] / s), lo, hi)
            q[pin[:, g] == col % block] = lo
            out[:, a + j] = q * s
            err[:, j] = (part[:, j] - out[:, a + j]) / u[a + j, a + j]
            part[:, j:] -= err[:, j : j + 1] * u[a + j, a + j : b][None, :]
        w[:, b:] -= err @ u[a:b, b:]
    result = torch.empty_like(out)
    result[:, order] = out
    return result.float()


def rounded_checkpoint(
    ckpt: Checkpoint,
    out: Path,
    bits: int,
    block: int,
    promoted: bool,
    files,
    log=print,
    head: bool = False,
) -> Path:
    """A copy of the checkpoint folder in `out` whose `bits`-bit matrices (with `head`, the
    head too) are rounded with GPTQ against `files` (per text file, windows of token ids), in
    float32; the rest unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    files = [f for f in files if f]
    if not files:
        raise ExportError(NO_TEXT)
    n_layers = int(ckpt.config["num_hidden_layers"])
    plan = targets(n_layers, promoted_layers(n_layers) if promoted else set())
    model = AutoModelForCausalLM.from_pretrained(str(ckpt.folder), dtype=torch.float32).eval()
    if head:
        plan[HEAD] = HEAD
        _untie(model)
    tokens = sum(len(w) for f in files for w in f)
    log(f"rounding {len(plan)} matrices with GPTQ against {tokens} tokens of {len(files)} files")
    hs = hessians(model, files, set(plan.values()))
    modules = dict(model.named_modules())
    for name, share in plan.items():
        mod = modules[name]
        mod.weight.data = round_matrix(mod.weight.data, hs[share], bits, block)
    out.mkdir(parents=True)
    for path in ckpt.folder.iterdir():  # tokenizer and templates: the builder reads them too
        skip = path.suffix == ".safetensors" or path.name.endswith(".index.json")
        if path.is_file() and not skip and path.name != "checksums.json":
            shutil.copy2(path, out / path.name)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def _untie(model) -> None:
    """The head as a matrix of its own where the checkpoint ties it to the embedding, so that
    rounding it leaves the embedding's weights as they were."""
    import torch

    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out.weight is emb.weight or out.weight.data_ptr() == emb.weight.data_ptr():
        out.weight = torch.nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
