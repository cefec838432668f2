"""`doel-export --embeddings`: BUNDLE/embeddings.onnx, the model's last hidden state (after its
final norm) pooled into one unit-length vector a text, for doel-serve's POST /v1/embeddings.

    inputs   input_ids [batch, tokens] int64, attention_mask [batch, tokens] int64 (1 for a
             token, 0 for right padding)
    output   embeddings [batch, hidden] float32, L2-normalized

Pooling is the manifest's to say (`embeddings.pooling`), since a reader cannot tell it from the
vectors: `mean` averages the tokens' states (what a causal LM's states support best without
training for it), `last` takes the last token's, the only state that has read the whole text.
The graph is fp32 and has no KV cache: a text is read once. It is checked against PyTorch on
the export's own texts (`max_abs_diff`, recorded), then written beside the decoder with its
sha256 added to the manifest's file table; what this is good for and what it is not:
docs/serving.md#embeddings-post-v1embeddings (measured in benchmarks/results/embeddings_*).

It is added to a finished bundle: its own files are written under temporary names and renamed
into place, the manifest last, so a failure leaves the bundle as it was.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from tokenizers import Tokenizer
from transformers import AutoModel

from doel.contracts.checksums import sha256_file
from doel.export.common import ExportError

POOLINGS = ("mean", "last")
FILE = "embeddings.onnx"
PARITY_BOUND = 1e-4  # |onnx − torch| on unit vectors: fp32 reordering, not a different graph
TEXTS = ("নদীর ধারে একটি ছোট গ্রাম", "The river runs past a small village.", "ঢাকা")
OPSET = 17


def _module(folder: Path, pooling: str):
    """The checkpoint's base model (no head) with pooling and normalization, in fp32."""
    base = AutoModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = base.eval()

        def forward(self, input_ids, attention_mask):
            # Causal attention and right padding: no token reads the padding after it, so the
            # causal mask is the whole mask; given as the 4D mask transformers uses as it is
            # (its own builder does not trace to a graph of any length)
            n = input_ids.shape[1]
            order = torch.arange(n)
            future = order.unsqueeze(0) > order.unsqueeze(1)
            causal = torch.zeros(n, n).masked_fill(future, torch.finfo(torch.float32).min)
            states = self.base(
                input_ids=input_ids,
                attention_mask=causal[None, None],
                position_ids=order.unsqueeze(0),
            )[0]
            mask = attention_mask.unsqueeze(-1).to(states.dtype)
            if pooling == "mean":
                pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            else:  # right padding: the last token is at count - 1
                last = (attention_mask.sum(1) - 1).clamp(min=0)
                pooled = states[torch.arange(states.shape[0]), last]
            return torch.nn.functional.normalize(pooled, dim=-1)

    return Pooled().eval(), base.config.hidden_size, base.config.vocab_size


def batch(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists right-padded into (input_ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


def _export(module, path: Path, vocab: int) -> None:
    example = (torch.randint(0, vocab, (2, 5)), torch.ones(2, 5, dtype=torch.int64))
    axes = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}}
    # The tracer warns of each shape it reads; the parity check below is what tells a graph
    # that does not generalize (several lengths and a padded batch)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["embeddings"],
            dynamic_axes=axes | {"embeddings": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )


def _parity(module, path: Path, rows: list[list[int]]) -> float:
    """max |onnx − torch| over `rows`, batched with padding (the padding is checked too)."""
    ids, mask = batch(rows)
    with torch.no_grad():
        want = module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    alone = [session.run(None, dict(zip(("input_ids", "attention_mask"), batch([r]))))[0][0]
             for r in rows]  # fmt: skip
    return float(max(np.abs(got - want).max(), np.abs(np.stack(alone) - want).max()))


def _check(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ExportError(f"--embeddings must be one of {', '.join(POOLINGS)}, got {pooling!r}")


def write_graph(checkpoint, path: Path, pooling: str, tokenizer: Path, log=print) -> dict:
    """The embeddings graph of `checkpoint` at `path` (renamed into place once it matches
    PyTorch on TEXTS, tokenized by `tokenizer`); its manifest record."""
    _check(pooling)
    tok = Tokenizer.from_file(str(tokenizer))
    rows = [e.ids for e in tok.encode_batch(list(TEXTS))]
    module, hidden, vocab = _module(Path(checkpoint), pooling)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        log(f"embeddings: exporting the last hidden state, {pooling} pooled ({hidden} dimensions)")
        _export(module, tmp, vocab)
        diff = _parity(module, tmp, rows)
        if not diff <= PARITY_BOUND:
            raise ExportError(
                f"{path.name} differs from PyTorch by {diff:.2e} (bound {PARITY_BOUND:g}); "
                "export again, and report it if it persists"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"embeddings: {path.name} matches PyTorch within {diff:.1e}")
    return {
        "model": path.name,
        "pooling": pooling,
        "normalized": True,
        "dimensions": hidden,
        "inputs": ["input_ids", "attention_mask"],
        "output": "embeddings",
        "max_abs_diff": diff,
    }


def add_embeddings(checkpoint: str | Path, bundle: str | Path, pooling: str = "mean", log=print):
    """Write BUNDLE/embeddings.onnx from `checkpoint` (the one the bundle was exported from) and
    record it in the manifest, written last; returns the manifest's `embeddings` record."""
    _check(pooling)
    bundle = Path(bundle)
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        raise ExportError(f"{bundle} is not an export bundle (no manifest.json); export it first")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    record = write_graph(checkpoint, bundle / FILE, pooling, bundle / "tokenizer.json", log)
    manifest["embeddings"] = record
    files = manifest.setdefault("files", {})
    files[FILE] = {"bytes": (bundle / FILE).stat().st_size, "sha256": sha256_file(bundle / FILE)}
    tmp_manifest = bundle / ".manifest.json.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", "utf-8")
    os.replace(tmp_manifest, manifest_path)
    return record
