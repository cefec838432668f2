"""The browser page (`doel-export --web`) beside doel-serve's engine on the same bundles, one run.

For each bundle (`--bundle NAME=DIR`; its web folder, with the fp32 graph beside the page's own,
is written into the scratch folder):
- `engine`: serve/core/engine.py in its own process (benchmarks/serve/bench_serve_engines.py,
  `doel`),
  at each of --threads;
- `page`: the web folder on a loopback static server that sends the cross-origin isolation
  headers, in Debian's headless Chromium (selenium), onnxruntime-web's WebAssembly build in the
  page's Web Worker, `?backend=wasm&threads=T&weights=W` for each of --weights (int8: the page's
  default; fp32: its former default; bundle: the bundle's MatMulNBits graph);
- `webgpu` (--webgpu NAME): the page on WebGPU (`--enable-unsafe-webgpu`): its adapter and
  greedy ids only; a software adapter's speed is never reported.
Both decode greedily from the same token ids (a SHORT- and a LONG-token prompt of random ids,
NEW new tokens, no stop ids), the best of REPEATS after a warm-up: time to first token (the
prefill and the first pick) and decode tokens/s (the ids after the first over their time). The
page's figures are its own performance.now() timings inside the worker; they include its
sampling and the streamed text, as the engine's include its sampling. Beside them: the page's
load time (cold: pieces fetched from the server; warm: from Cache Storage after a reload), the
largest peak resident memory of Chromium's processes (the renderer that holds the wasm heap),
whether the page's greedy ids equal the engine's (and where they first differ), the CPU class,
the CPU seconds other processes used meanwhile, and (--checkpoint NAME=DIR) the held-out loss
of each page graph against PyTorch fp32. bench_web_report.py writes the tables and the verdicts
on issue 34's targets.

Results: benchmarks/results/web_<bundles>_t<threads>_cpu-<class>.{json,md}. Run (it times:
hold the benchmark lock): `python -m benchmarks.web.bench_web --bundle demo=out/demo/bundle-int4
--checkpoint demo=DIR --bundle 0.4b=DIR --threads 1 --webgpu demo` (a 0.4B random-weight int4
bundle: `--make-0.4b WORK` builds one with bench_export's checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common.report import command, parser, publish, stamp
from benchmarks.export.bench_export import machine_busy_s, make_checkpoint, own_cpu_s
from benchmarks.web import bench_web_report, web_loss

RESULTS = ("web_<bundles>_t<threads>_cpu-<class>", "web_cpu-<class>")

ROOT = Path(__file__).resolve().parents[2]

SHORT, LONG, NEW, REPEATS = 128, 512, 64, 2
THREADS = (1, 2)
# Text a user would type (a trained model's continuations of it have wide top-2 gaps, unlike
# random ids): the greedy ids of each page path against the engine's.
TEXT_PROMPTS = ("নদীর ধারে একটি ছোট গ্রাম ছিল।", "The river was quiet that morning.")
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def tree_cpu_s() -> float:
    """CPU seconds of this process, its finished children and every live descendant (Chromium's
    processes hang below chromedriver)."""
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = fields
            kids.setdefault(int(fields[1]), []).append(int(d))
    total, todo = own_cpu_s(), list(kids.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        total += (int(stats[pid][11]) + int(stats[pid][12])) / os.sysconf("SC_CLK_TCK")
    return total


def descendants_peak_rss_mb(renderer: bool = False) -> float:
    """The largest VmHWM among this process's descendants (Chromium's processes hang below
    chromedriver); `renderer`: among its renderers only (`--type=renderer`: a tab, the page's
    worker and its WebAssembly memory), not the browser process every tab shares."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    best = 0.0
    for pid in parent:
        p = pid
        while p > 1 and p != os.getpid():
            p = parent.get(p, 0)
        if p != os.getpid() or pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if renderer and b"--type=renderer" not in f.read():
                    continue
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]) / 1024)
        except OSError:
            continue
    return best


def engine_row(bundle: Path, spec: dict, threads: int, work: Path) -> dict:
    path = work / f"spec-{threads}.json"
    path.write_text(json.dumps(spec | {"threads": threads}))
    out = work / f"engine-{bundle.name}-{threads}.json"
    cmd = command("serve.bench_serve_engines", "doel", bundle, path, out)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"engine run failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def engine_part(bundle: Path, spec: dict, threads: int, work: Path) -> dict:
    r = engine_row(bundle, spec, threads, work)
    out = {k: r[k] for k in ("short", "long", "load_s", "peak_rss_mb")}
    for part in ("short", "long"):
        out[part].pop("runs", None)
    return out


def engine_ids(engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """doel-serve's engine's greedy ids and, at each, the gap between its two largest logits
    (where the gap is small, the page's WebAssembly kernels may round to the other token)."""
    import numpy as np

    ids, gaps, logits = [], [], engine.forward(list(prompt), 0)
    for _ in range(NEW):
        top2 = np.sort(logits)[-2:]
        ids.append(int(np.argmax(logits)))
        gaps.append(float(top2[1] - top2[0]))
        logits = engine.forward([ids[-1]], len(prompt) + len(ids) - 1)
    return ids, gaps


def browser(*extra: str):
    """Headless Chromium through chromedriver; `extra`: more switches (--enable-unsafe-webgpu)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--no-proxy-server",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        *extra,
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
    driver.set_script_timeout(1200)
    return driver


def settled(driver, promise: str, *args, fail: bool = True) -> dict:
    """The value of a JS promise expression in the page, polled: one WebDriver command may not
    last past its client's timeout (120 s), which a 0.4B prefill on one WebAssembly thread can
    outlast. An error ends the run, or (fail=False) comes back as {"error": ...}."""
    driver.execute_script(
        f"window.__done = null; ({promise}).then("
        "(r) => (window.__done = r), (e) => (window.__done = {error: String(e)}));",
        *args,
    )
    while not (out := driver.execute_script("return window.__done")):
        time.sleep(0.5)
    if "error" in out and fail:
        raise SystemExit(f"the page failed: {out['error']}")
    return out


def page_row(url: str, spec: dict, threads: int, weights: str) -> dict:
    """One fresh browser: a cold load, a warm reload, the warm-up, the timed runs (WebAssembly,
    the page's `weights` graph)."""
    driver = browser()
    try:
        graph, _, simd = weights.partition("-")  # kernel-plain: the kernel's plain-SIMD build
        query = f"?backend=wasm&threads={threads}&weights={graph}" + (simd and f"&simd={simd}")
        driver.get(url + query)
        cold = settled(driver, "doel.ready")
        driver.get(url + query)
        warm = settled(driver, "doel.ready")
        if warm["graph"] != graph or (simd and warm["kernel"] != simd):
            raise SystemExit(f"the page ran {warm['graph']} ({warm['kernel']}), not {weights}")
        warm_up = {"prompt_ids": spec["prompts"]["short"][:8], "max_tokens": 2}
        settled(driver, "doel.generate(arguments[0])", warm_up)
        row = {"threads": warm["threads"], "isolated": warm["isolated"], "weights": weights}
        row |= {"kernel": warm["kernel"], "weights_in_memory": warm["weights_in_memory"]}
        row |= {"load_cold_s": cold["load_ms"] / 1000, "load_warm_s": warm["load_ms"] / 1000}
        for name in ("short", "long"):
            runs = []
            for _ in range(REPEATS):
                req = {"prompt_ids": spec["prompts"][name], "max_tokens": NEW}
                req |= {"temperature": 0, "stop_ids": []}
                last = settled(driver, "doel.generate(arguments[0])", req)
                first = last["prefill_ms"] / 1000
                runs.append(
                    {"ttft_s": first, "decode_tok_s": last["decode_tok_s"], "ids": last["ids"]}
                )
            row[name] = {
                "ttft_s": min(r["ttft_s"] for r in runs),
                "decode_tok_s": max(r["decode_tok_s"] for r in runs),
                "ids": runs[0]["ids"],
            }
        row["browser_peak_rss_mb"] = descendants_peak_rss_mb()
        row["tab_peak_rss_mb"] = descendants_peak_rss_mb(renderer=True)
        row["kernel_memory_mb"] = (last.get("kernel_memory_bytes") or 0) / 2**20 or None
        row["text_ids"] = text_ids(driver)
        return row
    finally:
        driver.quit()


def text_ids(driver) -> list[list[int]]:
    """The page's greedy ids for TEXT_PROMPTS (tokenized by the page, as a user's are)."""
    out = []
    for text in TEXT_PROMPTS:
        req = {"prompt": text, "max_tokens": NEW, "temperature": 0, "stop_ids": []}
        out.append(settled(driver, "doel.generate(arguments[0])", req)["ids"])
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def webgpu_row(url: str, prompt: list[int]) -> dict:
    """The page on WebGPU (Chromium --enable-unsafe-webgpu): its adapter and its greedy ids for
    `prompt`; no timing (a software adapter's speed is no GPU's)."""
    driver = browser("--enable-unsafe-webgpu")
    try:
        driver.get(f"{url}?backend=webgpu")
        facts = settled(driver, "doel.ready", fail=False)
        if "error" in facts or facts["backend"] != "webgpu":
            return {"kind": "webgpu", "error": facts.get("error") or facts.get("why")}
        req = {"prompt_ids": prompt, "max_tokens": NEW, "temperature": 0, "stop_ids": []}
        r = settled(driver, "doel.generate(arguments[0])", req)
        keep = ("adapter", "software_adapter", "why", "weights_in_memory")
        row = {"kind": "webgpu", **{k: facts[k] for k in keep}, "short": {"ids": r["ids"]}}
        return row | {"text_ids": text_ids(driver)}
    finally:
        driver.quit()


def timed(kind: str, threads: int, run) -> dict:
    """`run()`'s row with its wall time, the load and the CPU seconds other processes took."""
    print(f"{kind}, {threads} thread(s) ...", flush=True)
    busy, own, t0 = machine_busy_s(), tree_cpu_s(), time.perf_counter()
    r = run()
    wall = time.perf_counter() - t0
    foreign = max(0.0, (machine_busy_s() - busy) - (tree_cpu_s() - own))
    return {"kind": kind, "threads": threads, **r, "foreign_cpu_s": foreign, "wall_s": wall}


def measure_bundle(name: str, bundle: Path, work: Path, opts) -> dict:
    import numpy as np
    from tokenizers import Tokenizer

    from doel.export.web import static_server, write_web
    from doel.serve.core.engine import Engine, read_bundle

    manifest = json.loads((bundle / "manifest.json").read_text())
    web_dir = work / f"web-{name}"  # the page's graphs and the fp32 one beside them
    web = write_web(bundle, web_dir, log=lambda _m: None, graphs=("int8", "fp32"))
    rng = np.random.default_rng(0)
    vocab = min(manifest["tokenizer_vocab_size"], manifest["vocab_size"])
    long = min(LONG, manifest["context_length"] - NEW - 8)  # the demo model holds 512
    prompts = {
        k: rng.integers(16, vocab, n).tolist() for k, n in (("short", SHORT), ("long", long))
    }
    spec = {
        "n_ctx": manifest["context_length"],
        "new_tokens": NEW,
        "repeats": {k: REPEATS for k in prompts},
        "prompts": prompts,
    }
    server = static_server(web_dir)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    rows = []
    try:
        for threads in opts.threads:
            rows.append(
                timed("engine", threads, lambda t=threads: engine_part(bundle, spec, t, work))
            )
            for weights in opts.weights:
                run = lambda t=threads, w=weights: page_row(url, spec, t, w)  # noqa: E731
                rows.append(timed("page", threads, run))
        if name in opts.webgpu:
            rows.append(webgpu_row(url, prompts["short"]) | {"threads": None})
    finally:
        server.shutdown()
        server.server_close()
    engine = Engine(read_bundle(bundle), threads=2)  # one load for every prompt's ids
    want = {k: engine_ids(engine, prompts[k]) for k in prompts}
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    want_text = [engine_ids(engine, tok.encode(t).ids) for t in TEXT_PROMPTS]
    for r in rows:
        if r["kind"] in ("page", "webgpu") and "error" not in r:
            r["text_first_difference"] = [
                {"at": (i := first_difference(got, w[0])), "gap": None if i is None else w[1][i]}
                for got, w in zip(r.pop("text_ids"), want_text)
            ]
            at = {k: first_difference(r[k].pop("ids"), want[k][0]) for k in want if k in r}
            r["greedy_first_difference"] = at
            r["engine_top2_gap_there"] = {
                k: None if i is None else want[k][1][i] for k, i in at.items()
            }
    kv = manifest["kv_cache"]
    kv_bytes = 2 * kv["layers"] * kv["kv_heads"] * kv["head_dim"] * manifest["context_length"]
    kv_bytes *= 2 if kv["dtype"] == "float16" else 4
    return {
        "name": name,
        "bundle": bundle.name,
        "quantization": manifest["quantization"]["scheme"],
        "quant": manifest["quant"],
        "parameters": manifest["source"],
        "context_length": manifest["context_length"],
        "web_bytes": sum(p.stat().st_size for p in web_dir.iterdir() if p.is_file()),
        "weight_bytes": web["graphs"]["bundle"]["data_bytes"],
        "graph_bytes": {k: g["data_bytes"] for k, g in web["graphs"].items()},
        "weights_file_bytes": manifest["files"].get(f"{manifest['model']}.data", {}).get("bytes"),
        "kv_cache_bytes": kv_bytes,
        "prompt_tokens": {k: len(v) for k, v in prompts.items()},
        "rows": rows,
        "loss": web_loss.safe_losses(web_dir, web, manifest, opts.checkpoints.get(name), work),
    }


def make_big(work: Path) -> Path:
    """A 0.4B random-weight int4 bundle with its web folder (bench_export's checkpoint)."""
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        make_checkpoint(work, "bangla-0.4b")
    out = work / "bundle-int4"
    if not (out / "web" / "web.json").is_file():
        cmd = [sys.executable, "-m", "doel.export", str(ckpt), "--out", str(out), "--quant", "int4"]
        subprocess.run(cmd + ["--web", "--force", "--eval-tokens", "256"], cwd=ROOT, check=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--bundle", action="append", default=[], help="NAME=DIR (repeat)")
    ap.add_argument("--make-0.4b", dest="big", help="WORK folder: build (or reuse) a 0.4B bundle")
    ap.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="NAME=DIR: the bundle's checkpoint, for the held-out loss of the page's graphs",
    )
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument(
        "--weights",
        default="kernel,int8,fp32",
        help="the page's WebAssembly modes to time: kernel (doel's, the default; kernel-plain: "
        "its plain-SIMD build), int8, fp32, bundle (onnxruntime-web's graphs)",
    )
    ap.add_argument(
        "--webgpu",
        action="append",
        default=[],
        help="NAME: also check its WebGPU path's greedy ids",
    )
    args = ap.parse_args(argv)
    bundles = [tuple(b.split("=", 1)) for b in args.bundle]
    args.checkpoints = dict(c.split("=", 1) for c in args.checkpoint)
    if args.big:
        bundles.append(("0.4b", str(make_big(Path(args.big)))))
        args.checkpoints.setdefault("0.4b", str(Path(args.big) / "ckpt"))
    args.threads = [int(t) for t in args.threads.split(",")]
    args.weights = args.weights.split(",")
    import onnxruntime

    from doel.export.web import runtime_versions

    chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        measured = [measure_bundle(n, Path(d), Path(work), args) for n, d in bundles]
    result = stamp(python=True) | {
        "chromium": chromium.split()[1] if chromium else None,  # "Chromium 156.0... built on"
        "onnxruntime": onnxruntime.__version__,
        "runtime": runtime_versions(),
        "settings": {"short": SHORT, "long": LONG, "new_tokens": NEW, "repeats": REPEATS},
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "bundles": measured,
    }
    threads = "".join(map(str, args.threads))
    name = f"web_{'_'.join(n for n, _ in bundles)}_t{threads}_cpu-{result['cpu']['class']}"
    publish(args.out, name, result, bench_web_report.markdown(result))


if __name__ == "__main__":
    main()
