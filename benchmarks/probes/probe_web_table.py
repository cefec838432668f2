"""The Markdown of benchmarks/probes/probe_web_matmul.py's result: per shape and row count,
each way of holding the layer against each host (Node.js; Chromium per onnxruntime-web build)
and thread count, in ms a run and as a multiple of the fp32 MatMul on the same host; then the
verdict the page's modes are chosen by (the fastest way whose weights stay at 8 bits or fewer).
A row a column did not time (doel's single-threaded kernel at 2 threads) reads "—"; one that
failed in a host, its reason."""

from __future__ import annotations

from benchmarks.common.cpu_class import isa_summary


def columns(result: dict) -> list[tuple[str, str]]:
    return [(h, t) for h, by in result["hosts"].items() for t in sorted(by, key=int)]


def timed(run: dict, key: str) -> dict | None:
    """The row's {ms, err<rows>} in one column's run, or None where it has no time."""
    row = run.get("result", {}).get(key, {})
    return row if "ms" in row else None


def cell(result: dict, host: str, threads: str, key: str, rows: str) -> str:
    run = result["hosts"][host][threads]
    if "error" in run:
        return "failed"
    row = run["result"].get(key, {})
    if "ms" not in row:
        return row.get("error", "—")
    r = row["ms"][rows]
    base = run["result"][key.split("|")[0] + "|fp32 MatMul"]["ms"][rows]
    return f"{r:.2f} ({r / base:.1f}x)"


def small_and_fast(result: dict) -> list[str]:
    """Per host and threads: the fastest way (a graph or the kernel, timed in that column) with
    weights <= 8 bits in memory, vs fp32, decode rows, summed over the shapes (a layer of
    gate/up and down)."""
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

        def here(kind, run=run):
            return all(timed(run, f"{s}|{kind}") for s in shapes)

        best = min((k for k in sorted(kinds) if small(k) and here(k)), key=total)
        fp32 = total("fp32 MatMul")
        prefill = str(result["settings"]["rows"][-1])
        pre = total(best, prefill) / total("fp32 MatMul", prefill)
        lines.append(
            f"- {host}, {thr} thread(s): {best}: {total(best) / fp32:.1f}x fp32's time a decode "
            f"step ({total(best):.2f} vs {fp32:.2f} ms), {pre:.1f}x in a prefill chunk"
        )
    return lines


def kernel_note(result: dict) -> list[str]:
    """What the doel kernel rows are (results from before them have none)."""
    builds = result.get("kernel_sha256")
    if not builds:
        return []
    names = ", ".join(f"{name} sha256 {digest}…" for name, digest in builds.items())
    return [
        "The *doel kernel* rows are not onnxruntime-web: export/web/kernel.c's `dk_linear`, the "
        "page's default WebAssembly mode, on the MatMulNBits 4-bit block-256 bytes and scales "
        "as they are (4 bits in memory), A quantized to int8 a block of K inside each run; "
        "its plain-SIMD build and its relaxed-SIMD build (i8 x i7 dot), timed like the rest "
        "(a run copies A in and Y out, as session.run does), in the same worker or process as "
        "the column's onnxruntime-web build, which it does not use. It is single-threaded: "
        "— in the 2-thread columns. A build whose `dk_selftest` fails in a host (its engine "
        "computes relaxed SIMD's dot otherwise) is not timed there: *wrong numbers in this "
        f"host*. Builds: {names}.",
        "",
    ]


def markdown(result: dict) -> str:
    cpu = result["cpu"]
    cols = columns(result)
    mem = result["weights_in_memory_bytes"]
    lines = [
        f"# One linear layer in onnxruntime-web {result['runtime']} and doel's WebAssembly kernel: "
        f"Node.js and Chromium ({result['date']})",
        "",
        f"{cpu.get('model_name', '?')} ({isa_summary(cpu)}; class {cpu['class']}), "
        f"{result['machine']}; Node.js {result['node']}, Chromium {result['chromium']} (headless, "
        "a Web Worker in a cross-origin isolated page). "
        "`python -m benchmarks.probes.probe_web_matmul`: "
        "Y = A W, A [rows, K] fp32; the median of up to "
        f"{result['settings']['runs']} runs in {result['settings']['budget_ms']} ms after two "
        "warm-up runs. Builds: plain = ort.wasm.min.js (the page's WebAssembly mode), jsep = "
        "ort.min.js, webgpu = ort.webgpu.min.js, each on its WebAssembly EP. Load average "
        f"{result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after; other "
        f"processes took {result['foreign_cpu_s']:.0f} CPU s meanwhile (a shared machine: "
        "compare within a column).",
        "",
        *kernel_note(result),
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
                run = next((r for h, t in cols if (r := timed(result["hosts"][h][t], key))), None)
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
        "The fastest way whose weights stay at 8 bits or fewer in memory (a graph, or doel's "
        "kernel), a layer's gate/up and down projections together, against fp32 on the same "
        "host and threads:",
        "",
        *small_and_fast(result),
        "",
    ]
    return "\n".join(lines)
