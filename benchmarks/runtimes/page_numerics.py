"""The browser page's kernel on a real model: does it compute what ONNX Runtime computes?

The page (export/web/kernel.c) and ONNX Runtime's MatMulNBits both quantize each matrix's
activations to int8 per block of K (accuracy level 4), but sum other floats (the norms, the
attention) in another order. A value one rounding edge away then lands on the other integer, and
on a model with large activation outliers (SmolLM2's: the block that holds one has a step of
several units) one such step moves the logits by up to a logit. So greedy text cannot be the
test on real weights: where the top two logits are closer than that, either side is right. The
page is checked as its numerics allow, both against ONNX Runtime on the same int4 bundle:
- held-out loss: the kernel's (Node.js, web_kernel_node) and ONNX Runtime's on the same windows
  of the validation text, per language; a page that read a matrix, a scale or a norm wrong moves
  it by far more than the rounding does;
- the size of the rounding noise: ONNX Runtime against itself with the embedding's scales moved
  one ulp (a change no arithmetic can call wrong), beside the page against ONNX Runtime, as the
  largest logit difference over the same positions, and the same for the loss.
Rows from `rows(bundle, lines)`, for benchmarks/runtimes/real_model.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

WINDOWS, WINDOW = 12, 96  # per language: windows of the validation text, tokens each
NAME = "the browser page's kernel (doel-export --web, int4, Node.js)"


def windows(tokenizer, lines: dict[str, list[str]], n: int, size: int) -> dict[str, list]:
    """n windows of `size` ids a language, cut from the validation lines joined."""
    out = {}
    for lang, text in lines.items():
        ids = tokenizer.encode("\n".join(text[:400]), add_special_tokens=False).ids
        if len(ids) < n * size:
            raise ValueError(f"{lang}: {len(ids)} ids, fewer than {n} windows of {size}")
        out[lang] = [ids[i * size : (i + 1) * size] for i in range(n)]
    return out


def ort_logits(bundle: Path, wins: list[list[int]]) -> list[np.ndarray]:
    """ONNX Runtime's logits after each id of each window (doel-serve's engine, 2 threads)."""
    from doel.serve.core.engine import Engine, read_bundle

    engine = Engine(read_bundle(bundle), threads=2)
    return [engine.forward(w, 0, every=True) for w in wins]


def nats(logits: np.ndarray, ids: list[int]) -> float:
    """Summed nats of ids[1:] given the logits after each of ids[:-1]."""
    z = logits[:-1].astype(np.float64)
    top = z.max(-1)
    lse = top + np.log(np.exp(z - top[:, None]).sum(-1))
    return float((lse - z[np.arange(len(z)), ids[1:]]).sum())


def nudged(bundle: Path, to: Path) -> Path:
    """A copy of `bundle` whose token embedding's scales are one ulp larger."""
    import onnx
    from onnx import numpy_helper

    to.mkdir(parents=True, exist_ok=True)
    for f in bundle.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy(f, to / f.name)
    model = onnx.load(str(bundle / "model.onnx"))
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    for i, t in enumerate(model.graph.initializer):
        if t.name == gather.input[2]:
            up = np.nextafter(numpy_helper.to_array(t), np.float32(np.inf))
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(up, t.name))
    onnx.save(model, str(to / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data")  # fmt: skip
    manifest = json.loads((to / "manifest.json").read_text())
    for name in ("model.onnx", "model.onnx.data"):  # the checksums doel-serve verifies
        data = (to / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


def greedy_rows(bundle: Path, page: dict[str, str], serve: dict[str, str], chromium: str):
    """The page's greedy texts against doel-serve's on the same bundle, beside how many of
    them doel-serve itself keeps when the bundle is nudged one ulp (end_of_document's prompts
    and length): a page departure only where ONNX Runtime's own text moves too is rounding."""
    from benchmarks.runtimes.end_of_document import doel_serve

    with tempfile.TemporaryDirectory() as tmp:
        other = nudged(bundle, Path(tmp) / "nudged")
        moved = {p for p in page if doel_serve(other, p)["text"] != serve[p]}
    bad = {p for p in page if page[p] != serve[p]}
    shown = next(iter(sorted(bad)), next(iter(page)))
    result = (
        f"{len(page) - len(bad)} of {len(page)} identical (e.g. page {page[shown]!r}, doel-serve "
        f"{serve[shown]!r}); doel-serve on the bundle nudged one ulp: "
        f"{len(page) - len(moved)} of {len(page)} identical to itself"
    )
    check = "greedy completions == doel-serve's on the same int4 bundle, or move where its own do"
    name = "the browser page (doel-export --web, int4, its default path)"
    return [{"runtime": name, "version": f"Chromium {chromium}", "check": check,
             "result": result, "ok": bad <= moved}]  # fmt: skip


def measure(bundle: Path, lines: dict[str, list[str]], n: int = WINDOWS, size: int = WINDOW):
    """Per language: nats/token of ONNX Runtime, of it nudged, of the page (paired over the
    same windows), and the largest logit difference of each against ONNX Runtime."""
    from tokenizers import Tokenizer

    from benchmarks.web.web_kernel_node import kernel_logits

    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    by_lang = windows(tok, lines, n, size)
    wins = [w for ws in by_lang.values() for w in ws]  # every language's, one run each side
    with tempfile.TemporaryDirectory() as tmp:
        other = nudged(bundle, Path(tmp) / "nudged")
        runs = {"onnxruntime": ort_logits(bundle, wins), "nudged": ort_logits(other, wins),
                "page": kernel_logits(bundle / "web", wins)}  # fmt: skip
    out, at = {}, 0
    for lang, ws in by_lang.items():
        logits = {k: v[at : at + len(ws)] for k, v in runs.items()}
        at += len(ws)
        tokens = sum(len(w) - 1 for w in ws)
        per = {k: np.array([nats(z, w) for z, w in zip(v, ws)]) for k, v in logits.items()}
        out[lang] = {"tokens": tokens, "windows": len(ws)}
        out[lang] |= {k: float(v.sum()) / tokens for k, v in per.items()}
        for k in ("nudged", "page"):
            diffs = zip(logits[k], logits["onnxruntime"])
            out[lang][f"{k}_max_logit_diff"] = max(float(np.abs(x - y).max()) for x, y in diffs)
            d = (per[k] - per["onnxruntime"]) / (tokens / len(ws))
            out[lang][f"{k}_se"] = float(d.std(ddof=1) / np.sqrt(len(d)))
    return out


def rows(bundle: Path, lines: dict[str, list[str]], version: str, **sizes) -> list[dict]:
    """Two rows a language: the loss, and the logit noise beside ONNX Runtime's own (measure's
    n and size may be given)."""
    out = []
    for lang, m in measure(bundle, lines, **sizes).items():
        d_page, d_nudge = m["page"] - m["onnxruntime"], m["nudged"] - m["onnxruntime"]
        # the rounding's own spread on these windows: the nudge's shift and either paired SE
        bound = 3 * max(m["page_se"], m["nudged_se"], abs(d_nudge))
        out.append({
            "runtime": NAME, "version": version,
            "check": f"held-out loss == ONNX Runtime's on the same int4 bundle, {lang} "
                     f"({m['windows']} windows, {m['tokens']} tokens)",
            "result": f"page {m['page']:.4f}, ONNX Runtime {m['onnxruntime']:.4f} nats/token "
                      f"(Δ {d_page:+.4f} ± {m['page_se']:.4f}; ONNX Runtime nudged one ulp: "
                      f"Δ {d_nudge:+.4f})",
            "ok": abs(d_page) <= bound,
        })  # fmt: skip
        out.append({
            "runtime": NAME, "version": version,
            "check": f"largest logit difference from ONNX Runtime, {lang}: at most twice ONNX "
                     "Runtime's own under a one-ulp nudge of the embedding's scales, + 0.01",
            "result": f"page {m['page_max_logit_diff']:.3f}, "
                      f"ONNX Runtime nudged {m['nudged_max_logit_diff']:.3f}",
            "ok": m["page_max_logit_diff"] <= 2 * m["nudged_max_logit_diff"] + 0.01,
        })  # fmt: skip
    return out
