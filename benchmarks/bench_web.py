"""The browser page (`doel-export --web`) beside doel-serve's engine on the same bundles, one run.

For each bundle (`--bundle NAME=DIR`, exported with --web, or its web folder is written first):
- `engine`: serve/engine.py in its own process (benchmarks/bench_serve_engines.py, `doel`),
  at 1 and 2 threads;
- `page`: the web folder on a loopback static server that sends the cross-origin isolation
  headers, in Debian's headless Chromium (selenium), onnxruntime-web's WebAssembly build in the
  page's Web Worker, `?threads=1` and `?threads=2`.
Both decode greedily from the same token ids (a SHORT- and a LONG-token prompt of random ids,
NEW new tokens, no stop ids), the best of REPEATS after a warm-up: time to first token (the
prefill and the first pick) and decode tokens/s (the ids after the first over their time). The
page's figures are its own performance.now() timings inside the worker; they include its
sampling and the streamed text, as the engine's include its sampling. Beside them: the page's
load time (cold: pieces fetched from the server; warm: from Cache Storage after a reload), the
largest peak resident memory of Chromium's processes (the renderer that holds the wasm heap),
whether the page's greedy ids equal the engine's (and where they first differ), the CPU class
and the CPU seconds other processes used meanwhile.

Results: benchmarks/results/web_cpu-<class>.{json,md}. Run: `python -m benchmarks.bench_web
--bundle demo=out/demo/bundle-int4 --bundle 0.4b=DIR` (a 0.4B random-weight int4 bundle:
`--make-0.4b WORK` builds one with bench_export's checkpoint and `doel-export --web`).
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

from benchmarks.bench_export import machine_busy_s, make_checkpoint, own_cpu_s
from benchmarks.cpu_class import isa_summary
from benchmarks.report import command, heading, parser, publish, stamp

ROOT = Path(__file__).resolve().parents[1]

SHORT, LONG, NEW, REPEATS = 128, 512, 64, 2
THREADS = (1, 2)
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


def descendants_peak_rss_mb() -> float:
    """The largest VmHWM among this process's descendants (Chromium's renderer, mostly)."""
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
    cmd = command("bench_serve_engines", "doel", bundle, path, out)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"engine run failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def engine_ids(bundle: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The engine's greedy ids and, at each, the gap between its two largest logits (where the
    gap is small, the page's WebAssembly kernels may round to the other token)."""
    import numpy as np

    from doel.serve.engine import Engine, read_bundle

    engine = Engine(read_bundle(bundle), threads=2)
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


def page_row(url: str, spec: dict, threads: int) -> dict:
    """One fresh browser: a cold load, a warm reload, the warm-up, the timed runs."""
    driver = browser()
    try:
        driver.get(f"{url}?threads={threads}&memory=fp32")
        cold = settled(driver, "doel.ready")
        driver.get(f"{url}?threads={threads}&memory=fp32")
        warm = settled(driver, "doel.ready")
        warm_up = {"prompt_ids": spec["prompts"]["short"][:8], "max_tokens": 2}
        settled(driver, "doel.generate(arguments[0])", warm_up)
        row = {"threads": warm["threads"], "isolated": warm["isolated"]}
        row |= {"load_cold_s": cold["load_ms"] / 1000, "load_warm_s": warm["load_ms"] / 1000}
        for name in ("short", "long"):
            runs = []
            for _ in range(REPEATS):
                req = {"prompt_ids": spec["prompts"][name], "max_tokens": NEW}
                req |= {"temperature": 0, "stop_ids": []}
                r = settled(driver, "doel.generate(arguments[0])", req)
                first = r["prefill_ms"] / 1000
                runs.append({"ttft_s": first, "decode_tok_s": r["decode_tok_s"], "ids": r["ids"]})
            row[name] = {
                "ttft_s": min(r["ttft_s"] for r in runs),
                "decode_tok_s": max(r["decode_tok_s"] for r in runs),
                "ids": runs[0]["ids"],
            }
        row["browser_peak_rss_mb"] = descendants_peak_rss_mb()
        return row
    finally:
        driver.quit()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_bundle(name: str, bundle: Path, work: Path) -> dict:
    import numpy as np

    from doel.export.web import static_server, write_web

    manifest = json.loads((bundle / "manifest.json").read_text())
    if not (bundle / "web" / "web.json").is_file():
        write_web(bundle)
    web = json.loads((bundle / "web" / "web.json").read_text())
    rng = np.random.default_rng(0)
    vocab = min(manifest["tokenizer_vocab_size"], manifest["vocab_size"])
    long = min(LONG, manifest["context_length"] - NEW - 8)  # the demo model holds 512
    prompts = {
        k: rng.integers(16, vocab, n).tolist() for k, n in (("short", SHORT), ("long", long))
    }
    spec = {
        "n_ctx": manifest["context_length"],
        "new_tokens": NEW,
        "repeats": {"short": REPEATS, "long": REPEATS},
        "prompts": prompts,
    }
    server = static_server(bundle / "web")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    rows = []
    try:
        for threads in THREADS:
            for kind in ("engine", "page"):
                print(f"{name}: {kind}, {threads} thread(s) ...", flush=True)
                busy, own, t0 = machine_busy_s(), tree_cpu_s(), time.perf_counter()
                if kind == "engine":
                    r = engine_row(bundle, spec, threads, work)
                    r = {k: r[k] for k in ("short", "long", "load_s", "peak_rss_mb")}
                    for part in ("short", "long"):
                        r[part].pop("runs", None)
                else:
                    r = page_row(url, spec, threads)
                wall = time.perf_counter() - t0
                foreign = max(0.0, (machine_busy_s() - busy) - (tree_cpu_s() - own))
                rows.append(
                    {
                        "kind": kind,
                        "threads": threads,
                        **r,
                        "foreign_cpu_s": foreign,
                        "wall_s": wall,
                        "load_avg": os.getloadavg(),
                    }
                )
    finally:
        server.shutdown()
        server.server_close()
    want = {k: engine_ids(bundle, prompts[k]) for k in ("short", "long")}
    for r in rows:
        if r["kind"] == "page":
            at = {k: first_difference(r[k].pop("ids"), want[k][0]) for k in want}
            r["greedy_first_difference"] = at
            r["engine_top2_gap_there"] = {
                k: None if i is None else want[k][1][i] for k, i in at.items()
            }
    return {
        "name": name,
        "bundle": bundle.name,
        "quantization": manifest["quantization"]["scheme"],
        "parameters": manifest["source"],
        "context_length": manifest["context_length"],
        "web_bytes": sum(p.stat().st_size for p in (bundle / "web").iterdir()),
        "weight_bytes": web["data_bytes"],
        "prompt_tokens": {"short": SHORT, "long": long},
        "rows": rows,
    }


def markdown(result: dict) -> str:
    cpu = result["cpu"]
    lines = [
        *heading("The browser page vs doel-serve's engine", result, with_machine=False),
        f"{cpu['model_name']} ({isa_summary(cpu)}; class {cpu['class']}), {result['machine']}; "
        f"Chromium {result['chromium']}, onnxruntime-web {result['runtime']['onnxruntime-web']} "
        "(WebAssembly, SIMD) vs onnxruntime "
        f"{result['onnxruntime']} (native). Greedy, random prompt ids, {NEW} new tokens, best "
        f"of {REPEATS}; load average {result['load_before'][0]:.2f} before, "
        f"{result['load_after'][0]:.2f} after.",
        "",
        "| bundle | engine | threads | TTFT short (s) | decode tok/s, short | TTFT long (s) | "
        "decode tok/s, long | page / engine, short | peak RSS MB | other CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in result["bundles"]:
        eng = {r["threads"]: r for r in b["rows"] if r["kind"] == "engine"}
        for r in b["rows"]:
            ratio = r["short"]["decode_tok_s"] / eng[r["threads"]]["short"]["decode_tok_s"]
            rss = r.get("peak_rss_mb") or r.get("browser_peak_rss_mb")
            who = "doel-serve engine" if r["kind"] == "engine" else "page (wasm)"
            tokens = f"{b['prompt_tokens']['short']}/{b['prompt_tokens']['long']}"
            lines.append(
                f"| {b['name']} ({tokens}) | {who} | {r['threads']} | {r['short']['ttft_s']:.3f} | "
                f"{r['short']['decode_tok_s']:.1f} | {r['long']['ttft_s']:.3f} | "
                f"{r['long']['decode_tok_s']:.1f} | {ratio:.2f} | {rss:.0f} | "
                f"{r['foreign_cpu_s']:.1f} |"
            )
    lines += [
        "",
        "| bundle | weights MB | web folder MB | page load cold / warm (s), 1 thread |"
        " page greedy ids = engine's (first difference) |",
        "|---|---:|---:|---|---|",
    ]
    for b in result["bundles"]:
        page = [r for r in b["rows"] if r["kind"] == "page"]
        diffs = "; ".join(
            f"{r['threads']} thr: "
            + ", ".join(
                f"{k} equal"
                if v is None
                else f"{k} at {v} (engine's top-2 gap {r['engine_top2_gap_there'][k]:.3f})"
                for k, v in r["greedy_first_difference"].items()
            )
            for r in page
        )
        lines.append(
            f"| {b['name']} | {b['weight_bytes'] / 1e6:.1f} | {b['web_bytes'] / 1e6:.1f} | "
            f"{page[0]['load_cold_s']:.2f} / {page[0]['load_warm_s']:.2f} | {diffs} |"
        )
    return "\n".join(lines) + "\n"


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
    args = ap.parse_args(argv)
    bundles = [tuple(b.split("=", 1)) for b in args.bundle]
    if args.big:
        bundles.append(("0.4b", str(make_big(Path(args.big)))))
    import onnxruntime

    from doel.export.web import runtime_versions

    chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        measured = [measure_bundle(n, Path(d), Path(work)) for n, d in bundles]
    result = stamp(python=True) | {
        "chromium": chromium.split()[1] if chromium else None,  # "Chromium 156.0... built on"
        "onnxruntime": onnxruntime.__version__,
        "runtime": runtime_versions(),
        "settings": {"short": SHORT, "long": LONG, "new_tokens": NEW, "repeats": REPEATS},
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "bundles": measured,
    }
    publish(args.out, f"web_cpu-{result['cpu']['class']}", result, markdown(result))


if __name__ == "__main__":
    main()
