"""Held-out loss of what the browser page computes, for bench_web: each page graph in native
ONNX Runtime (the same contrib kernels as onnxruntime-web's WebAssembly build, other SIMD), and
doel's kernel itself in Node.js (benchmarks/web/web_kernel_node.py) on the first KERNEL_TOKENS
targets, beside PyTorch fp32 on the same text and the bound the export holds that quantization to.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.web.web_kernel_node import kernel_nats

ROOT = Path(__file__).resolve().parents[2]
# held-out text for the page graphs' loss (../shared/data, as bench_quant_quality reads it)
LOSS_TEXTS = (
    "../shared/data/bn/bnlp_resources_news_punct/news_test_news.txt",
    "../shared/data/en/gutenberg/pg1342_pride_and_prejudice_austen.txt",
)
LOSS_TOKENS = 4096
KERNEL_TOKENS = 1024  # one token a forward in Node.js: ~0.1 s a token at 0.4B


def safe_losses(*args) -> dict | None:
    """page_losses, or its error: the timed rows before it are not lost to it."""
    try:
        return page_losses(*args)
    except Exception as e:  # noqa: BLE001 (a failed loss check is reported, the run kept)
        return {"error": f"{type(e).__name__}: {e}"}


def page_losses(web_dir: Path, web: dict, manifest: dict, ckpt: str | None, work: Path):
    """Held-out loss (nats/token) of PyTorch fp32 and of each page graph on the shared
    validation text, the graphs run by native ONNX Runtime (the same contrib kernels as the
    page's WebAssembly build, other SIMD), and the bound the export holds that quantization
    to. None without the checkpoint."""
    if ckpt is None:
        return None
    import numpy as np

    from doel.contracts.quant import quant
    from doel.export import parity
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.runner import OnnxLM, score

    c = inspect_checkpoint(ckpt)
    texts = parity.eval_texts(c, [ROOT / t for t in LOSS_TEXTS], LOSS_TOKENS)
    window = min(manifest["context_length"], 512)
    tokens = sum(len(d) - 1 for t in texts for d in t["docs"])

    def nats(logits) -> float:
        return sum(score(logits, t["docs"], window) for t in texts) / tokens

    out = {"texts": list(LOSS_TEXTS), "tokens": tokens, "window": window}
    ref = parity.torch_reference(c)
    out["torch_fp32"] = nats(ref)
    out["bound"] = quant(manifest["quant"]).loss_bound
    for name, g in web["graphs"].items():
        folder = work / f"loss-{web_dir.name}-{name}"
        folder.mkdir()
        with open(folder / g["data_path"], "wb") as f:
            for p in g["data"]:
                f.write((web_dir / p["file"]).read_bytes())
        (folder / g["model"]).write_bytes((web_dir / g["model"]).read_bytes())
        lm = OnnxLM(folder / g["model"], c.kv_heads, c.head_dim, threads=2)
        keep = lm.session

        def run(names, feeds, keep=keep):  # the page feeds logits_to_keep (0: every position)
            return keep.run(names, feeds | {"logits_to_keep": np.array([0], np.int64)})

        lm.session = type("Keep", (), {"run": staticmethod(run)})()
        out[name] = nats(lm.logits)
        shutil.rmtree(folder)
    try:
        out["kernel"] = kernel_loss(web_dir, web, texts, window, ref)
    except RuntimeError as e:  # no Node.js, or the kernel failed: the graphs' figures stand
        out["kernel"] = {"error": str(e)}
    return out


def kernel_loss(web_dir: Path, web: dict, texts: list[dict], window: int, ref) -> dict:
    """doel's kernel's nats/token on the first KERNEL_TOKENS targets, and PyTorch fp32's (`ref`,
    a logits function) on the same windows."""
    import numpy as np

    from doel.export.runner import nll_sum, windows

    if not web["graphs"]["bundle"].get("kernel"):
        return {"error": web["graphs"]["bundle"].get("kernel_why")}
    chosen, tokens = [], 0
    for w in (w for t in texts for d in t["docs"] for w in windows(d, window)):
        if tokens >= KERNEL_TOKENS:
            break
        chosen.append(w)
        tokens += len(w) - 1
    torch = sum(nll_sum(ref(np.array([w[:-1]]))[0], np.array(w[1:])) for w in chosen)
    return {
        "tokens": tokens,
        "kernel": sum(kernel_nats(web_dir, chosen)) / tokens,
        "torch_fp32": torch / tokens,
    }
