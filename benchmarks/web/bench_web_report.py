"""The Markdown of benchmarks/web/bench_web.py's result: the page's WebAssembly modes beside
doel-serve's engine (speed, memory, greedy ids), its WebGPU path's ids, the held-out loss of each
graph, and issue 34's targets with a verdict each (the page's default WebAssembly mode: peak
memory <= 1.4x the bundle's weights file plus its KV cache, decode >= 0.17x the engine's, aim
0.35x; at least as fast as the fp32 mode; loss within the export's bound)."""

from __future__ import annotations

from benchmarks.common.cpu_class import isa_summary
from benchmarks.common.report import heading

MEMORY_TARGET, DECODE_TARGET, DECODE_AIM = 1.4, 0.17, 0.35


def who(r: dict) -> str:
    if r["kind"] == "engine":
        return "doel-serve engine"
    if r["weights"].startswith("kernel"):
        return f"page (doel's kernel, {r.get('kernel') or 'relaxed'} SIMD, int4)"
    return f"page (onnxruntime-web, {r['weights']})"


def default_mode(pages: dict) -> str:
    """The page's WebAssembly default among the timed rows: doel's kernel (int8 before it)."""
    return "kernel" if any(w == "kernel" for w, _ in pages) else "int8"


def speed_table(result: dict) -> list[str]:
    lines = [
        "| bundle | engine | threads | TTFT short (s) | decode tok/s, short | TTFT long (s) | "
        "decode tok/s, long | page / engine, short | peak RSS MB (engine; page: its tab) | "
        "other CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in result["bundles"]:
        eng = {r["threads"]: r for r in b["rows"] if r["kind"] == "engine"}
        tokens = f"{b['prompt_tokens']['short']}/{b['prompt_tokens']['long']}"
        for r in (r for r in b["rows"] if r["kind"] in ("engine", "page")):
            ratio = r["short"]["decode_tok_s"] / eng[r["threads"]]["short"]["decode_tok_s"]
            rss = r.get("peak_rss_mb") or tab_mb(r)
            lines.append(
                f"| {b['name']} ({tokens}) | {who(r)} | {r['threads']} | "
                f"{r['short']['ttft_s']:.3f} | {r['short']['decode_tok_s']:.1f} | "
                f"{r['long']['ttft_s']:.3f} | {r['long']['decode_tok_s']:.1f} | {ratio:.2f} | "
                f"{rss:.0f} | {r['foreign_cpu_s']:.1f} |"
            )
    return lines


def tab_mb(r: dict) -> float:
    """A page row's peak: its tab's renderer (older results: Chromium's largest process)."""
    return r.get("tab_peak_rss_mb") or r["browser_peak_rss_mb"]


def text_ids_text(r: dict) -> str:
    """The page's greedy ids on the typed prompts against the engine's."""
    if "text_first_difference" not in r:
        return ""
    parts = [
        "equal" if d["at"] is None else f"at {d['at']} (engine's top-2 gap {d['gap']:.3f})"
        for d in r["text_first_difference"]
    ]
    return f"; typed prompts (bn, en): {', '.join(parts)}"


def ids_text(r: dict) -> str:
    return ", ".join(
        f"{k} equal"
        if v is None
        else f"{k} at {v} (engine's top-2 gap {r['engine_top2_gap_there'][k]:.3f})"
        for k, v in r["greedy_first_difference"].items()
    ) + text_ids_text(r)


def ids_table(result: dict) -> list[str]:
    lines = [
        "| bundle | weights MB (bundle / int8 / fp32 graph) | web folder MB | page load cold / "
        "warm (s) | page greedy ids = engine's (first difference) |",
        "|---|---|---:|---|---|",
    ]
    for b in result["bundles"]:
        pages = [r for r in b["rows"] if r["kind"] == "page"]
        mb = " / ".join(
            f"{b['graph_bytes'][g] / 1e6:.1f}" if g in b["graph_bytes"] else "-"
            for g in ("bundle", "int8", "fp32")
        )
        loads = "; ".join(
            f"{r['weights']} {r['threads']} thr {r['load_cold_s']:.2f} / {r['load_warm_s']:.2f}"
            for r in pages
        )
        diffs = "; ".join(f"{r['weights']} {r['threads']} thr: {ids_text(r)}" for r in pages)
        lines.append(f"| {b['name']} | {mb} | {b['web_bytes'] / 1e6:.1f} | {loads} | {diffs} |")
    gpu = [(b, r) for b in result["bundles"] for r in b["rows"] if r["kind"] == "webgpu"]
    if gpu:
        lines += ["", "WebGPU (Chromium `--enable-unsafe-webgpu`; ids only, never a speed):", ""]
    for b, r in gpu:
        if "error" in r:
            lines.append(f"- {b['name']}: no WebGPU path: {r['error']}")
            continue
        soft = " (a software adapter)" if r["software_adapter"] else ""
        lines.append(
            f"- {b['name']}: adapter {r['adapter']}{soft}, weights {r['weights_in_memory']}; "
            f"greedy ids vs the engine's: {ids_text(r)}"
        )
    return lines


def loss_lines(result: dict) -> list[str]:
    lines = []
    for b in result["bundles"]:
        loss = b.get("loss")
        if not loss:
            continue
        if "error" in loss:
            lines += [f"Held-out loss, {b['name']}: not measured ({loss['error']}).", ""]
            continue
        lines += [
            f"Held-out loss, {b['name']} ({loss['tokens']} tokens of {', '.join(loss['texts'])}, "
            f"windows of {loss['window']}; the graphs in native ONNX Runtime): PyTorch fp32 "
            f"{loss['torch_fp32']:.4f} nats/token; the export's bound for {b['quant']}: "
            f"+{loss['bound']} nats/token.",
            "",
            "| graph | nats/token | increase over fp32 | within the bound |",
            "|---|---:|---:|---|",
        ]
        for g in ("bundle", "int8", "fp32"):
            if g in loss:
                inc = loss[g] - loss["torch_fp32"]
                ok = "yes" if loss["bound"] is None or inc <= loss["bound"] else "**no**"
                lines.append(f"| {g} (native ONNX Runtime) | {loss[g]:.4f} | {inc:+.4f} | {ok} |")
        k = loss.get("kernel")
        if k and "error" in k:
            lines.append(f"| doel's kernel | not measured: {k['error']} | | |")
        elif k:
            inc = k["kernel"] - k["torch_fp32"]
            ok = "yes" if loss["bound"] is None or inc <= loss["bound"] else "**no**"
            lines.append(
                f"| doel's kernel (the page's own numbers, Node.js; the first {k['tokens']} "
                f"targets, where PyTorch fp32 gives {k['torch_fp32']:.4f}) | {k['kernel']:.4f} | "
                f"{inc:+.4f} | {ok} |"
            )
        lines.append("")
    return lines


def floor_mb(result: dict, mode: str) -> tuple[str, float] | None:
    """The page's own floor in this run: the smallest peak of the smallest bundle's page in
    `mode` (Chromium's renderer, the page and its runtime, a model of a few MB), where the run
    has a second bundle."""
    if len(result["bundles"]) < 2:
        return None
    small = min(result["bundles"], key=lambda b: b["weight_bytes"])
    rows = small["rows"]
    peaks = [tab_mb(r) for r in rows if r["kind"] == "page" and r["weights"] == mode]
    return (small["name"], min(peaks)) if peaks else None


def verdicts(result: dict) -> list[str]:
    lines = []
    for b in result["bundles"]:
        eng = {r["threads"]: r for r in b["rows"] if r["kind"] == "engine"}
        pages = {(r["weights"], r["threads"]): r for r in b["rows"] if r["kind"] == "page"}
        base = ((b["weights_file_bytes"] or 0) + b["kv_cache_bytes"]) / 2**20
        budget = MEMORY_TARGET * base
        default = default_mode(pages)
        for (w, t), r in pages.items():
            if w != default:
                continue
            ratio = r["short"]["decode_tok_s"] / eng[t]["short"]["decode_tok_s"]
            rss = tab_mb(r)
            fp32 = pages.get(("fp32", t))
            vs = ""
            if fp32:
                fast = r["short"]["decode_tok_s"] / fp32["short"]["decode_tok_s"]
                vs = (
                    f"; vs the fp32 mode {fast:.2f}x decode ("
                    f"{'at least as fast' if fast >= 1 else '**slower**'}), "
                    f"{r['long']['ttft_s'] / fp32['long']['ttft_s']:.2f}x long TTFT, "
                    f"{rss / tab_mb(fp32):.2f}x peak memory"
                )
            former = pages.get(("int8", t)) if default != "int8" else None
            if former:
                vs += (
                    f"; vs the former default (onnxruntime-web int8) "
                    f"{r['short']['decode_tok_s'] / former['short']['decode_tok_s']:.2f}x decode, "
                    f"{rss / tab_mb(former):.2f}x peak memory"
                )
            floor = floor_mb(result, default)
            tab = (
                f"the tab's floor in this run ({rss:.0f} MB)"
                if floor and floor[0] == b["name"]
                else f"the tab's peak {rss:.0f} MB vs {budget:.0f} MB ({MEMORY_TARGET}x (weights "
                f"file + KV cache at {b['context_length']})): "
                f"{'met' if rss <= budget else '**not met**'}"
            )
            lines.append(
                f"- {b['name']}, {t} thread(s), the default ({who(r)}): {tab}; decode "
                f"{ratio:.2f}x the engine's (target {DECODE_TARGET}x: "
                f"{'met' if ratio >= DECODE_TARGET else '**not met**'}, aim {DECODE_AIM}x: "
                f"{'met' if ratio >= DECODE_AIM else 'not met'}){vs}"
            )
            if floor and floor[0] != b["name"]:
                above = rss - floor[1]
                lines.append(
                    f"  - the model's own memory, above the tab's floor in this run (the same "
                    f"mode's tab on {floor[0]}, {floor[1]:.0f} MB: Chromium's renderer, the page "
                    f"and its runtime with a model of a few MB): {above:.0f} MB, "
                    f"{above / base:.2f}x (weights file + KV cache): "
                    f"{'met' if above <= budget else '**not met**'}"
                )
    return lines


def markdown(result: dict) -> str:
    cpu = result["cpu"]
    lines = [
        *heading("The browser page vs doel-serve's engine", result, with_machine=False),
        f"{cpu['model_name']} ({isa_summary(cpu)}; class {cpu['class']}), {result['machine']}; "
        f"Chromium {result['chromium']}, onnxruntime-web {result['runtime']['onnxruntime-web']} "
        f"(WebAssembly, SIMD) vs onnxruntime {result['onnxruntime']} (native). Greedy, random "
        f"prompt ids, {result['settings']['new_tokens']} new tokens, best of "
        f"{result['settings']['repeats']}; load average {result['load_before'][0]:.2f} before, "
        f"{result['load_after'][0]:.2f} after. Page rows: `?backend=wasm&weights=W` (kernel: "
        "doel's own WebAssembly kernel on the bundle's int4 weights, the page's default; int8: "
        "onnxruntime-web's DynamicQuantizeMatMul, the default before it; fp32: the int4 "
        "integers folded to fp32 at load, the default before that; bundle: onnxruntime-web's "
        "MatMulNBits). A page's peak: the VmHWM of its tab's renderer process (the page, its "
        "worker and the WebAssembly memory; the browser process every tab shares is not "
        "counted).",
        "",
        *speed_table(result),
        "",
        *ids_table(result),
        "",
        *loss_lines(result),
        "Targets (issue 34):",
        "",
        *verdicts(result),
        "",
    ]
    return "\n".join(lines)
