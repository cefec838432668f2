"""The proof that an exported graph computes the checkpoint's model, written into the manifest:

- logits against PyTorch (transformers, fp32) on fixed prompts: max |onnx − torch| / max |torch|;
- the KV-cache path (prefill half, then token by token) against the graph's own full forward;
- the held-out loss increase against PyTorch fp32, in nats/token and bits/character;
- the ORT-format model against the ONNX model it came from.

A figure past its bound fails the export with the figure in the message. Relative error is taken
against the largest logit, not elementwise: logits near zero would make an elementwise ratio
meaningless.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np

from doel.contracts.quant import QUANTS, names
from doel.contracts.quant import quant as quant_row
from doel.export.checkpoint import Checkpoint
from doel.export.common import ExportError, sha256_file
from doel.export.runner import OnnxLM, bits, score

PROMPTS = [
    "আমাদের গ্রামের নাম নদীপাড়া। সকালে বৃষ্টি হলে আমরা স্কুলে যাই না।",
    "বাংলাদেশের রাজধানী ঢাকা, আর এর জনসংখ্যা দুই কোটির বেশি।",
    "Once upon a time, in a small town by the river, there lived an old boatman.",
]
RANDOM_PROMPT_LEN = 64  # plus one prompt of random ids, to reach positions the text does not
LOGITS_BOUND = 1e-4  # fp32 graph vs PyTorch
KV_BOUND = 1e-4  # fp32: the cache path equals the full forward
# Quantized graphs: MatMulNBits with int8 activations takes one kernel path for a single row
# and another for many, so prefill-then-step differs from one full pass by an amount of the
# order of the quantization itself (0.02 relative at 0.4B int8, where int8 differs from PyTorch
# by 0.04). The cache path may add no more than that difference, and at least this much:
KV_FLOOR_QUANTIZED = 1e-2
# The held-out loss increase a quantized graph may add: its row's loss_bound (doel.contracts).
ORT_BOUND = 1e-5
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "train" / "sample"


def torch_reference(ckpt: Checkpoint):
    """The checkpoint in PyTorch fp32, through transformers (which loads doel's folders
    unchanged), as a function from ids [B, T] to numpy logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt.folder), dtype=torch.float32).eval()

    def logits(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()

    return logits


def prompt_ids(ckpt: Checkpoint) -> list[np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt.tokenizer))
    n = min(RANDOM_PROMPT_LEN, ckpt.context_length)
    rand = np.random.default_rng(0).integers(0, ckpt.tokenizer_vocab_size, size=n)
    ids = [tok.encode(p).ids[: ckpt.context_length] for p in PROMPTS] + [rand.tolist()]
    return [np.array([i], dtype=np.int64) for i in ids if len(i) >= 2]


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))


def logits_parity(lm: OnnxLM, ref_logits, prompts: list[np.ndarray]) -> dict:
    rel, absolute, agree, n = 0.0, 0.0, 0, 0
    for ids in prompts:
        got, want = lm.logits(ids), ref_logits(ids)
        rel, absolute = max(rel, rel_err(got, want)), max(absolute, float(np.abs(got - want).max()))
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        n += ids.shape[1]
    return {"max_rel_err": rel, "max_abs_err": absolute, "top1_agreement": agree / n}


def kv_parity(lm: OnnxLM, prompts: list[np.ndarray]) -> dict:
    rel = 0.0
    for ids in prompts:
        full = lm.logits(ids)
        rel = max(rel, rel_err(lm.logits_with_cache(ids, max(1, ids.shape[1] // 2)), full))
    return {"max_rel_err": rel}


def read_documents(path: Path) -> list[str]:
    """.txt (blank-line separated paragraphs, else one document a line) or .jsonl (`text`)."""
    if not path.is_file():
        raise ExportError(f"--text {path}: no such file")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        try:
            docs = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ExportError(
                f"--text {path}: every line must be JSON with a 'text' field ({e})"
            ) from None
    elif path.suffix in (".txt", ".md", ""):
        docs = raw.split("\n\n") if "\n\n" in raw else raw.splitlines()
    else:
        raise ExportError(f"--text {path}: give .txt or .jsonl files")
    return [d.strip() for d in docs if d.strip()]


def eval_texts(ckpt: Checkpoint, paths, max_tokens: int, rest_tokens: int = 0) -> list[dict]:
    """Token ids and NFC character counts per file, at most max_tokens / files tokens each;
    with `rest_tokens`, also each file's next documents past those (up to rest_tokens / files
    tokens, in "rest"): text the loss is not measured on, for calibration.

    The last document may be cut at a token; its characters are then counted up to that token's
    end (tokenizer offsets), so bits/character stay exact.
    """
    from tokenizers import Tokenizer

    paths = [Path(p) for p in paths] or sorted(SAMPLE_DIR.glob("*.txt"))
    if not paths:
        raise ExportError("no held-out text to measure the quantization loss on; pass --text")
    tok = Tokenizer.from_file(str(ckpt.tokenizer))
    budget = max(2, max_tokens // len(paths))
    out = []
    for path in paths:
        docs, chars, tokens, rest, spare = [], 0, 0, [], rest_tokens // len(paths)
        for text in read_documents(path):
            enc = tok.encode(unicodedata.normalize("NFC", text))
            if tokens >= budget:  # the loss check's text is read: the rest is calibration's
                rest.append(enc.ids[:spare])
                spare -= len(rest[-1])
                if spare <= 0:
                    break
                continue
            ids = enc.ids[: budget - tokens + 1]
            if len(ids) < 2:
                continue
            docs.append(ids)
            chars += max(end for _, end in enc.offsets[: len(ids)])
            tokens += len(ids) - 1
            if tokens >= budget and not rest_tokens:
                break
        if not docs:
            raise ExportError(f"--text {path}: no document of two tokens or more")
        entry = {"name": path.name, "sha256": sha256_file(path), "docs": docs, "chars": chars}
        if rest_tokens:
            entry["rest"] = [r for r in rest if len(r) > 1]
        out.append(entry)
    return out


def loss_increase(lm: OnnxLM, ref_logits, texts: list[dict], window: int) -> dict:
    """Held-out loss of the graph and of PyTorch fp32 on the same windows, and the increase."""
    files, sums = [], {"tokens": 0, "chars": 0, "torch": 0.0, "onnx": 0.0}
    for t in texts:
        tokens = sum(len(d) - 1 for d in t["docs"])
        ref, got = score(ref_logits, t["docs"], window), score(lm.logits, t["docs"], window)
        for k, v in (("tokens", tokens), ("chars", t["chars"]), ("torch", ref), ("onnx", got)):
            sums[k] += v
        files.append(_loss_row(t["name"], tokens, t["chars"], ref, got) | {"sha256": t["sha256"]})
    total = _loss_row("all", sums["tokens"], sums["chars"], sums["torch"], sums["onnx"])
    return total | {"window": window, "files": files}


def _loss_row(name: str, tokens: int, chars: int, ref: float, got: float) -> dict:
    return {
        "text": name,
        "tokens": tokens,
        "chars": chars,
        "torch_nats_per_token": ref / tokens,
        "onnx_nats_per_token": got / tokens,
        "increase_nats_per_token": (got - ref) / tokens,
        "increase_bits_per_char": bits(got - ref) / chars,
    }


def kv_bound(quant: str, quantized_vs_torch: float) -> float:
    if not quant_row(quant).quantized:
        return KV_BOUND
    return max(KV_FLOOR_QUANTIZED, quantized_vs_torch)


def _finer(quant: str) -> list[str]:
    """The ONNX formats that store more bits than `quant`, fewest first: what to try instead."""
    bits = {n: QUANTS[n].bits or 32 for n in names("onnx")}
    return sorted((n for n in bits if bits[n] > bits[quant]), key=bits.get)


def check(parity: dict, quant: str, max_loss: float | None) -> None:
    """Fail with every figure that is past its bound and what to do about it."""
    failed, row = [], quant_row(quant, "onnx")
    logits = parity["logits_vs_torch"]
    if not row.quantized and logits["max_rel_err"] > LOGITS_BOUND:
        failed.append(
            f"{quant} logits differ from PyTorch by {logits['max_rel_err']:.2e} (max relative "
            f"error; bound {LOGITS_BOUND:.0e})"
        )
    kv = parity["kv_cache_vs_full"]
    kv["bound"] = kv_bound(quant, logits["max_rel_err"])
    if kv["max_rel_err"] > kv["bound"]:
        failed.append(
            f"the KV-cache path differs from the full forward by {kv['max_rel_err']:.2e} "
            f"(bound {kv['bound']:.1e})"
        )
    loss = parity["loss"]
    bound = max_loss if max_loss is not None else row.loss_bound
    loss["bound_nats_per_token"] = bound
    if bound is not None and loss["increase_nats_per_token"] > bound:
        finer = [f"--quant {n}" for n in _finer(quant)[:1]]
        failed.append(
            f"{quant} raises the held-out loss by {loss['increase_nats_per_token']:.4f} "
            f"nats/token ({loss['increase_bits_per_char']:.4f} bits/char; bound {bound} "
            f"nats/token): try {' or '.join([*finer, 'a smaller --block-size'])}, or pass "
            "--max-loss-increase if that loss is acceptable"
        )
    if failed:
        raise ExportError("parity check failed: " + "; ".join(failed))


def ort_parity(onnx_lm: OnnxLM, ort_lm: OnnxLM, prompts: list[np.ndarray]) -> dict:
    rel = max(rel_err(ort_lm.logits(p), onnx_lm.logits(p)) for p in prompts)
    if rel > ORT_BOUND:
        raise ExportError(
            f"parity check failed: the ORT-format model differs from the ONNX model by {rel:.2e} "
            f"(bound {ORT_BOUND:.0e}); export without --mobile and report this"
        )
    return {"max_rel_err": rel, "bound": ORT_BOUND}
