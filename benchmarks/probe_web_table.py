"""The Markdown of benchmarks/probe_web_matmul.py's result: per shape and row count, each way of
holding the layer against each host (Node.js; Chromium per onnxruntime-web build) and thread
count, in ms a run and as a multiple of the fp32 MatMul on the same host; then the verdict the
page's modes are chosen by (the fastest graph whose weights stay at 8 bits or fewer)."""

from __future__ import annotations

from benchmarks.cpu_class import isa_summary


def columns(result: dict) -> list[tuple[str, str]]:
    return [(h, t) for h, by in result["hosts"].items() for t in sorted(by, key=int)]


def cell(result: dict, host: str, threads: str, key: str, rows: str) -> str:
    run = result["hosts"][host][threads]
    if "error" in run:
        return "failed"
    r = run["result"][key]["ms"][rows]
    base = run["result"][key.split("|")[0] + "|fp32 MatMul"]["ms"][rows]
    return f"{r:.2f} ({r / base:.1f}x)"


def small_and_fast(result: dict) -> list[str]:
    """Per host and threads: the fastest graph with weights <= 8 bits in memory, vs fp32,
    decode rows, summed over the shapes (a layer of gate/up and down)."""
    mem = result["weights_in_memory_bytes"]
    shapes = list(result["settings"]["shapes"])
    kinds = {k.split("|", 1)[1] for k in mem}
    lines = []
    for host, thr in columns(result):
        run = result["hosts"][host][thr]
        if "error" in run:
            lines.append(f"- {host}, {thr} thread(s): failed: {run['error']}")
            continue

        def total(kind, rows="1", run=run):
            return sum(run["result"][f"{s}|{kind}"]["ms"][rows] for s in shapes)

        def small(kind):
            return all(
                mem[f"{s}|{kind}"]
                <= 1.05 * result["settings"]["shapes"][s][0] * result["settings"]["shapes"][s][1]
                for s in shapes
            )

        best = min((k for k in kinds if small(k)), key=total)
        fp32 = total("fp32 MatMul")
        prefill = str(result["settings"]["rows"][-1])
        pre = total(best, prefill) / total("fp32 MatMul", prefill)
        lines.append(
            f"- {host}, {thr} thread(s): {best}: {total(best) / fp32:.1f}x fp32's time a decode "
            f"step ({total(best):.2f} vs {fp32:.2f} ms), {pre:.1f}x in a prefill chunk"
        )
    return lines


def markdown(result: dict) -> str:
    cpu = result["cpu"]
    cols = columns(result)
    mem = result["weights_in_memory_bytes"]
    lines = [
        f"# One linear layer in onnxruntime-web {result['runtime']}: Node.js and Chromium "
        f"({result['date']})",
        "",
        f"{cpu.get('model_name', '?')} ({isa_summary(cpu)}; class {cpu['class']}), "
        f"{result['machine']}; Node.js {result['node']}, Chromium {result['chromium']} (headless, "
        "a Web Worker in a cross-origin isolated page). `python -m benchmarks.probe_web_matmul`: "
        "Y = A W, A [rows, K] fp32; the median of up to "
        f"{result['settings']['runs']} runs in {result['settings']['budget_ms']} ms after two "
        "warm-up runs. Builds: plain = ort.wasm.min.js (the page's WebAssembly mode), jsep = "
        "ort.min.js, webgpu = ort.webgpu.min.js, each on its WebAssembly EP. Load average "
        f"{result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after; other "
        f"processes took {result['foreign_cpu_s']:.0f} CPU s meanwhile (a shared machine: "
        "compare within a column).",
        "",
    ]
    for shape, (k, n) in result["settings"]["shapes"].items():
        for rows in map(str, result["settings"]["rows"]):
            what = "decode step" if rows == "1" else "prefill chunk"
            lines += [
                f"## {shape} [{rows}, {k}] x [{k}, {n}] ({what}): ms a run (x fp32 on the host)",
                "",
                "| weights held as | MB in memory | rel. error vs fp32 | "
                + " | ".join(f"{h} {t}t" for h, t in cols)
                + " |",
                "|---|---:|---:|" + "---:|" * len(cols),
            ]
            for key in (m for m in mem if m.startswith(shape + "|")):
                run = next(
                    (r["result"][key] for h, t in cols if "result" in (r := result["hosts"][h][t])),
                    None,
                )
                err = f"{run[f'err{rows}']:.1e}" if run else "-"
                lines.append(
                    f"| {key.split('|', 1)[1]} | {mem[key] / 1e6:.1f} | {err} | "
                    + " | ".join(cell(result, h, t, key, rows) for h, t in cols)
                    + " |"
                )
            lines.append("")
    lines += [
        "## Small and fast?",
        "",
        "The fastest graph whose weights stay at 8 bits or fewer in memory, a layer's gate/up and "
        "down projections together, against fp32 on the same host and threads:",
        "",
        *small_and_fast(result),
        "",
    ]
    return "\n".join(lines)
