"""`doel-export --web`: BUNDLE/web/, a static page that runs the bundle inside a browser.

Any phone or laptop with a current browser opens it, offline once loaded, with no app store and
no server beyond static files: the model runs in a Web Worker on onnxruntime-web's WebAssembly
build (SIMD; threads where the page is cross-origin isolated), the text is tokenized by
tokenizers.js reading the bundle's tokenizer.json, and whole Bengali clusters stream into the
page (export/web/worker.js ports serve/textstream.py's rule).

    web/index.html, worker.js, sw.js    doel's page, its worker, its service worker (export/web/)
    web/web.json                        what the worker loads (below)
    web/model.onnx                      the bundle's graph, rewritten for WebAssembly (below)
    web/model-<sha256[:16]>.bin ...     its weights cut into pieces of at most CHUNK_BYTES
    web/tokenizer.json, tokenizer_config.json
    web/ort.wasm.min.js, ort-wasm-simd-threaded.{mjs,wasm}   onnxruntime-web (npm, MIT)
    web/tokenizers.min.js               @huggingface/tokenizers (npm, Apache-2.0; CommonJS build)

Why so:
- onnxruntime-web's wasm build carries ONNX Runtime's CPU contrib operators, so the bundle's
  graph runs there (GroupQueryAttention, MatMulNBits, GatherBlockQuantized, SkipSimplifiedLayer-
  Normalization), but its MatMulNBits kernel has no fast WebAssembly path: the 0.4B int4 model
  decoded ~37x slower than doel-serve. The page's graph therefore holds the same integers and
  scales as DequantizeLinear + MatMul, which ONNX Runtime folds into fp32 matrices once, at load
  (~5x faster decode, ~3x the memory: 2.7 GB at 0.4B; benchmarks/results/web_cpu-*.md); the
  page's ?memory=low (or a browser reporting under 8 GB) lets it fuse them back into
  MatMulNBits instead: int4 in memory, slow. `logits_to_keep` (an overridable initializer,
  export/graph.py) becomes a plain input: the page lists only inputs without an initializer and
  refuses other feeds. And the cache grows one position a step (GroupQueryAttention's
  concatenating mode, present = past + new) instead of serve's buffer at the full context
  written in place: wasm copies every input and output across the JavaScript boundary on each
  run, and a full-context buffer would copy the whole context's cache twice a token.
- The weights are pieces named by their hash, so the page keeps each in Cache Storage and a new
  export never reads a stale one; the worker checks each fresh piece's sha256.
- Threads: a browser gives WebAssembly threads only to a cross-origin isolated page (two response
  headers). `python -m export.web serve` sends them; on a host that cannot (GitHub Pages), the
  page's service worker (sw.js) adds them and the page reloads once. Without either: one thread.
- The runtime comes from the npm registry at export time (export/web/package-lock.json pins it),
  installed once into a cache folder (DOEL_WEB_RUNTIME names a node_modules folder instead).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from doel.contracts.manifest import Manifest, ManifestError, read_manifest
from doel.export.common import ExportError, fresh_dir, sha256_file, write_json

PAGE = Path(__file__).with_name("web")  # index.html, worker.js, package.json, package-lock.json
PAGE_FILES = ("index.html", "worker.js", "sw.js")
CHUNK_BYTES = 32 << 20  # a piece of the weights: small enough for any cache and a phone's fetch
LOGITS_TO_KEEP = "logits_to_keep"
WEB_DATA = "model.web.data"  # the page's weights, joined from the pieces in the browser
# node_modules path -> name in the web folder
RUNTIME_FILES = {
    "onnxruntime-web/dist/ort.wasm.min.js": "ort.wasm.min.js",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.mjs": "ort-wasm-simd-threaded.mjs",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.wasm": "ort-wasm-simd-threaded.wasm",
    "@huggingface/tokenizers/dist/tokenizers.min.cjs": "tokenizers.min.js",
    "@huggingface/tokenizers/LICENSE": "LICENSE.tokenizers-js.txt",
}
NPM_HINT = (
    "install Node.js's npm (e.g. apt-get install npm), which fetches them from the npm "
    "registry once, or set DOEL_WEB_RUNTIME to a node_modules folder holding them"
)


def runtime_versions() -> dict[str, str]:
    return json.loads((PAGE / "package.json").read_text(encoding="utf-8"))["dependencies"]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "doel"


def runtime_modules(log=print) -> Path:
    """A node_modules folder with RUNTIME_FILES: DOEL_WEB_RUNTIME's, or the cached `npm ci` of
    export/web/package-lock.json (made here on first use)."""
    wanted = ", ".join(f"{k}@{v}" for k, v in runtime_versions().items())
    if os.environ.get("DOEL_WEB_RUNTIME"):
        mods = Path(os.environ["DOEL_WEB_RUNTIME"])
        missing = [f for f in RUNTIME_FILES if not (mods / f).is_file()]
        if missing:
            raise ExportError(f"DOEL_WEB_RUNTIME={mods} lacks {missing[0]}; it needs {wanted}")
        return mods
    cache = cache_root() / f"web-runtime-{sha256_file(PAGE / 'package-lock.json')[:12]}"
    mods = cache / "node_modules"
    if all((mods / f).is_file() for f in RUNTIME_FILES):
        return mods
    npm = shutil.which("npm")
    if npm is None:
        raise ExportError(f"--web needs {wanted}: {NPM_HINT}")
    log(f"installing {wanted} from the npm registry into {cache} (once)")
    cache.parent.mkdir(parents=True, exist_ok=True)
    work = fresh_dir(cache.parent, f".{cache.name}.", ".tmp")
    try:
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(PAGE / name, work / name)
        cmd = [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"]
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-10:])
            raise ExportError(f"npm ci for {wanted} failed (exit {proc.returncode}):\n{tail}")
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(work, cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return mods


def unpack_nbits(b: np.ndarray, bits: int, k: int) -> np.ndarray:
    """MatMulNBits' weight [N, blocks, bytes] (uint8, zero point 2^(bits-1), the builder's
    symmetric form) as signed integers [N, K]."""
    flat = b.reshape(b.shape[0], -1).astype(np.int16)
    if bits == 4:
        flat = np.stack([flat & 0xF, flat >> 4], axis=-1).reshape(b.shape[0], -1)
    return (flat[:, :k] - (1 << (bits - 1))).astype(np.int8)


def _int4_tensor(name: str, q: np.ndarray) -> onnx.TensorProto:
    """ONNX INT4 [K, N]: two values a byte, the first in the low nibble."""
    u = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    raw = (u[0::2] | (u[1::2] << 4)).tobytes()
    return onnx.helper.make_tensor(name, onnx.TensorProto.INT4, list(q.shape), raw, raw=True)


def dequantize_nodes(g: onnx.GraphProto) -> int:
    """Each MatMulNBits without zero points becomes DequantizeLinear (the same integers and
    scales, blocked along K) + MatMul; returns how many. In WebAssembly MatMulNBits has no fast
    kernel (one [1, 1024] x [1024, 2816] product: 14-17 ms, an fp32 MatMul 0.3-0.7 ms;
    benchmarks/probe_web_matmul.py). The page then either lets ONNX Runtime fold each pair into
    an fp32 matrix at load (fast, large) or fuse it back into MatMulNBits (small, slow)."""
    inits = {t.name: t for t in g.initializer}
    nodes = [n for n in g.node if n.op_type == "MatMulNBits" and len(n.input) == 3]
    for node in nodes:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        k, n, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
        q = unpack_nbits(numpy_helper.to_array(inits[node.input[1]]), bits, k).T.copy()
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(n, -1).T.astype(np.float32)
        names = [f"{node.name}/{x}" for x in ("q", "scales", "weight")]
        qt = _int4_tensor(names[0], q) if bits == 4 else numpy_helper.from_array(q, names[0])
        g.initializer.extend([qt, numpy_helper.from_array(np.ascontiguousarray(scales), names[1])])
        for name in node.input[1:]:
            g.initializer.remove(inits[name])
        at = list(g.node).index(node)
        dq = onnx.helper.make_node(
            "DequantizeLinear",
            names[:2],
            names[2:],
            name=f"{node.name}/DQ",
            axis=0,
            block_size=block,
        )
        mm = onnx.helper.make_node(
            "MatMul", [node.input[0], names[2]], list(node.output), name=f"{node.name}/MatMul"
        )
        g.node.remove(node)
        g.node.insert(at, mm)
        g.node.insert(at, dq)
    return len(nodes)


def web_graph(src: Path, out: Path) -> dict:
    """The page's graph of `src` in out/model.onnx, its weights in out/WEB_DATA: logits_to_keep a
    plain input, MatMulNBits as DequantizeLinear + MatMul where the opset has blocked
    DequantizeLinear (21)."""
    m = onnx.load(str(src))  # the weights too: the quantized ones are rewritten
    g = m.graph
    inputs = {i.name for i in g.input}
    found = [t for t in g.initializer if t.name == LOGITS_TO_KEEP and t.name in inputs]
    for t in found:
        g.initializer.remove(t)
    opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
    rewritten = dequantize_nodes(g) if opset >= 21 else 0
    onnx.save(
        m,
        str(out / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=WEB_DATA,
        size_threshold=1024,
    )
    return {"logits_to_keep": bool(found), "dequantized_matmuls": rewritten}


def split_data(data: Path, out: Path, chunk: int = CHUNK_BYTES) -> list[dict]:
    """`data` cut into pieces of at most `chunk` bytes, each named by its sha256."""
    pieces = []
    with open(data, "rb") as f:
        while block := f.read(chunk):
            digest = hashlib.sha256(block).hexdigest()
            name = f"model-{digest[:16]}.bin"
            (out / name).write_bytes(block)
            pieces.append({"file": name, "bytes": len(block), "sha256": digest})
    return pieces


def stop_ids(special: dict) -> list[int]:
    """EOS, and the chat turn's end where the vocabulary has it (the model ends a reply so)."""
    ids = [special["eos"]["id"]] if "eos" in special else []
    end = special.get("added", {}).get("<|end|>")
    return ids + ([end] if end is not None and end not in ids else [])


def write_web(
    bundle: Path,
    out: Path | None = None,
    log=print,
    chunk: int = CHUNK_BYTES,
    manifest: dict | None = None,
    name: str | None = None,
) -> dict:
    """Write the web folder of `bundle` (default BUNDLE/web); return its web.json and size.
    `manifest` and `name` stand in for the bundle's manifest.json and folder name while
    doel-export is still writing it."""
    bundle = Path(bundle)
    out = Path(out) if out is not None else bundle / "web"
    try:
        m = read_manifest(bundle) if manifest is None else Manifest.from_dict(manifest)
    except ManifestError as e:
        raise ExportError(str(e)) from None
    if m.kind != "onnx":
        raise ExportError(f"{bundle} holds a {m.kind} file; the page runs an ONNX bundle")
    model = bundle / m.model
    mods = runtime_modules(log)
    out.mkdir(parents=True, exist_ok=True)
    graph_facts = web_graph(model, out)
    data_path = WEB_DATA if (out / WEB_DATA).is_file() else None
    pieces = split_data(out / data_path, out, chunk) if data_path else []
    if data_path:
        (out / data_path).unlink()  # the page joins the pieces
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (bundle / file).is_file():
            shutil.copyfile(bundle / file, out / file)
    for src, file in RUNTIME_FILES.items():
        shutil.copyfile(mods / src, out / file)
    for file in PAGE_FILES:
        shutil.copyfile(PAGE / file, out / file)
    notices = []
    for pkg in runtime_versions():
        meta = json.loads((mods / pkg / "package.json").read_text(encoding="utf-8"))
        notices.append(
            f"{pkg} {meta['version']}: {meta.get('license')} license, {meta.get('homepage', '')}"
        )
    (out / "THIRD_PARTY.txt").write_text("\n".join(notices) + "\n", encoding="utf-8")
    kv = m.kv_cache
    spec = {
        "format": "doel-web",
        "format_version": 1,
        "bundle": name or bundle.resolve().name,
        "model": "model.onnx",
        "data_path": data_path,
        "data": pieces,
        "data_bytes": sum(p["bytes"] for p in pieces),
        "past_names": [i["name"] for i in m.extra["inputs"] if i["name"].startswith("past_")],
        "kv_heads": kv.kv_heads,
        "head_dim": kv.head_dim,
        "kv_dtype": kv.dtype,
        "position_ids": bool(kv.position_ids_input),
        **graph_facts,
        "vocab_size": m.vocab_size,
        "context_length": m.context_length,
        "stop_ids": stop_ids(m.special_tokens),
        "quant": m.quant,
        "quantization": m.extra["quantization"]["scheme"],
        "runtime": runtime_versions(),
    }
    write_json(out / "web.json", spec)
    return spec | {"bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file())}


class StaticHandler(http.server.SimpleHTTPRequestHandler):
    """Static files, scripts and WebAssembly with the types browsers insist on, quietly."""

    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript",
        ".js": "text/javascript",
        ".wasm": "application/wasm",
    }

    def log_message(self, *args):  # one line a file would bury the address
        pass


class IsolatedHandler(StaticHandler):
    """With the two headers that make a page cross-origin isolated, which browsers require
    before they give it SharedArrayBuffer, and so WebAssembly threads (without them, the page's
    sw.js adds them and reloads once)."""

    def end_headers(self):
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()


def static_server(folder: Path, port: int = 0, host: str = "127.0.0.1", isolated: bool = True):
    """A threading HTTP server of `folder` (call serve_forever); `isolated` sends the headers."""
    handler = IsolatedHandler if isolated else StaticHandler
    return http.server.ThreadingHTTPServer(
        (host, port), functools.partial(handler, directory=str(folder))
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m export.web",
        description="write BUNDLE/web for an existing bundle, or serve a web folder locally",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write the web folder of a doel-export bundle")
    w.add_argument("bundle")
    w.add_argument("--out", help="default BUNDLE/web")
    s = sub.add_parser("serve", help="serve a web folder on loopback, threads enabled")
    s.add_argument("folder")
    s.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    if args.cmd == "write":
        try:
            spec = write_web(Path(args.bundle), args.out and Path(args.out))
        except ExportError as e:
            sys.exit(f"error: {e}")
        print(f"wrote {args.out or Path(args.bundle) / 'web'} ({spec['bytes'] / 1e6:.1f} MB)")
        return
    server = static_server(Path(args.folder), args.port)
    print(f"serving {args.folder} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
