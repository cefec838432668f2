"""`doel-export --web`: BUNDLE/web/, a static page that runs the bundle in a browser, offline once
loaded, with no server beyond static files.

    web/index.html, worker.js, sw.js    the page, its Web Worker and its service worker (PAGE)
    web/web.json                        what the worker loads: its graphs and their pieces
    web/model.onnx, model.int8.onnx     the page's graphs (GRAPHS, made by web_graph)
    web/model-<sha256[:16]>.bin ...     each graph's weights in pieces of at most CHUNK_BYTES
    web/tokenizer.json, tokenizer_config.json
    web/ort*.{js,mjs,wasm}, tokenizers.min.js   onnxruntime-web and @huggingface/tokenizers
                                        from npm (RUNTIME_FILES)

The rules it keeps, and why:
- WebGPU runs the bundle's own graph on onnxruntime-web's 4-bit kernels. WebAssembly runs it on
  doel's kernel (web_kernel), 4 bits in memory, where the graph has the kernel's shape, else
  onnxruntime-web runs the int8 graph (a low-memory device: the bundle's): onnxruntime-web has no
  fast 4-bit WebAssembly kernel (benchmarks/results/web_probe_cpu-intel-avx512-amx.md,
  benchmarks/results/web_demo_0.4b_t1_cpu-intel-avx512-amx.md).
- The cache grows one position a step, not a full-context buffer written in place as serve's:
  WebAssembly copies every input and output across the JavaScript boundary on each run.
- The weights are pieces named by their hash: the page keeps each in Cache Storage, a new export
  never reads a stale one, and the worker checks each fresh piece's sha256.
- WebAssembly threads need a cross-origin isolated page: `python -m doel.export.web serve` sends
  its two headers; where a host cannot (GitHub Pages), the service worker adds them and the page
  reloads once. Without either: one thread.
- The runtime is the one package-lock.json pins, installed from npm once into a cache folder
  (DOEL_WEB_RUNTIME names a node_modules folder instead).
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

from doel.contracts.decoding import CONTEXT_IDS
from doel.contracts.manifest import Manifest, ManifestError, read_manifest
from doel.export.common import ExportError, fresh_dir, sha256_file, write_json
from doel.export.web_graph import web_graph
from doel.export.web_kernel import WASM, NotKernelShape, kernel_layout

PAGE = Path(__file__).with_name("web")  # index.html, worker.js, package.json, package-lock.json
PAGE_FILES = ("index.html", "worker.js", "sw.js", *WASM.values())
CHUNK_BYTES = 32 << 20  # a piece of the weights: small enough for any cache and a phone's fetch
WEB_DATA = "model.web.data"  # the page's weights, joined from the pieces in the browser
# The page's graphs: name -> (graph file, weights file); the page ships `bundle` (the bundle's
# own: WebGPU's and doel's kernel's) and int8 (WebAssembly's where the kernel cannot run); fp32
# is written only when asked for (the web benchmark measures it beside the others).
GRAPHS = {
    "bundle": ("model.onnx", WEB_DATA),
    "int8": ("model.int8.onnx", "model.int8.data"),
    "fp32": ("model.fp32.onnx", "model.fp32.data"),
}
PAGE_GRAPHS = ("bundle", "int8")
# node_modules path -> name in the web folder
RUNTIME_FILES = {
    "onnxruntime-web/dist/ort.wasm.min.js": "ort.wasm.min.js",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.mjs": "ort-wasm-simd-threaded.mjs",
    "onnxruntime-web/dist/ort-wasm-simd-threaded.wasm": "ort-wasm-simd-threaded.wasm",
    # the WebGPU build (its own WebAssembly binary: ONNX Runtime's WebGPU EP, asyncify)
    "onnxruntime-web/dist/ort.webgpu.min.js": "ort.webgpu.min.js",
    **{
        f"onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.{x}": (
            f"ort-wasm-simd-threaded.asyncify.{x}"
        )
        for x in ("mjs", "wasm")
    },
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


def page_graph(model: Path, out: Path, weights: str, chunk: int) -> dict:
    """The `weights` graph (GRAPHS) of `model` in `out`, its weights cut into pieces."""
    name, data = GRAPHS[weights]
    facts = web_graph(model, out, name, data, weights)
    pieces = split_data(out / data, out, chunk) if (out / data).is_file() else []
    if pieces:
        (out / data).unlink()  # the page joins the pieces
    return facts | {
        "model": name,
        "data_path": data if pieces else None,
        "data": pieces,
        "data_bytes": sum(p["bytes"] for p in pieces),
    }


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
    """EOS, and the chat turn's end (the model ends a reply so): the manifest's end_of_turn, the
    token the model's chat template closes a reply with (export/chat.py), else doel's <|end|>
    where the vocabulary has it (a bundle written before end_of_turn was recorded)."""
    ids = [special["eos"]["id"]] if "eos" in special else []
    end = (special.get("end_of_turn") or {}).get("id", special.get("added", {}).get("<|end|>"))
    return ids + ([end] if end is not None and end not in ids else [])


def write_web(
    bundle: Path,
    out: Path | None = None,
    log=print,
    chunk: int = CHUNK_BYTES,
    manifest: dict | None = None,
    name: str | None = None,
    graphs: tuple[str, ...] = PAGE_GRAPHS,
) -> dict:
    """Write the web folder of `bundle` (default BUNDLE/web); return its web.json and size.
    `manifest` and `name` stand in for the bundle's manifest.json and folder name while
    doel-export is still writing it. `graphs`: which of GRAPHS (bundle always)."""
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
    made = {w: page_graph(model, out, w, chunk) for w in ("bundle", *graphs) if w in GRAPHS}
    try:  # doel's kernel runs the bundle's graph from its own weights
        made["bundle"] |= {"kernel": kernel_layout(out / GRAPHS["bundle"][0]), "kernel_why": None}
    except NotKernelShape as e:
        made["bundle"] |= {"kernel": None, "kernel_why": str(e)}
    for w in [w for w in made if w != "bundle" and not made[w]["rewritten_matmuls"]]:
        (out / GRAPHS[w][0]).unlink()  # no quantized matmuls: the bundle's graph is the same
        dropped = made.pop(w)["data"]
        kept = {p["file"] for g in made.values() for p in g["data"]}
        for p in dropped:  # pieces are named by their content: another graph's may be the same
            if p["file"] not in kept:
                (out / p["file"]).unlink(missing_ok=True)
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
        # the bundle graph's, as format 1 had them (graphs lists each)
        **{k: made["bundle"][k] for k in ("model", "data_path", "data", "data_bytes")},
        "graphs": made,
        "past_names": [i["name"] for i in m.extra["inputs"] if i["name"].startswith("past_")],
        "kv_heads": kv.kv_heads,
        "head_dim": kv.head_dim,
        "kv_dtype": kv.dtype,
        "position_ids": bool(kv.position_ids_input),
        "logits_to_keep": made["bundle"]["logits_to_keep"],
        "vocab_size": m.vocab_size,
        "context_length": m.context_length,
        "stop_ids": stop_ids(m.special_tokens),
        "context_ids": CONTEXT_IDS,  # prompt ids decoded in front of the completion
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
        prog="python -m doel.export.web",
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
