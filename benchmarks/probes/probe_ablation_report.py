"""probe_ablation's Markdown: each part's milliseconds a token, the per-shape matrices, the
flash-attention A/B and the bandwidth, each sentence computed from the result's figures."""

from __future__ import annotations

from benchmarks.common.report import cpu_line
from benchmarks.probes import probe_chain

PARTS = {
    "gqa": "GroupQueryAttention",
    "norms": "the norms",
    "activation": "the activation",
    "head": "the head",
}


def costs(ms: dict) -> dict:
    """{part: ms the step loses without it}, "rest": the step with all four out."""
    full = ms["full"]
    out = {p: full - ms[f"no {p}"] for p in PARTS}
    return out | {"sum": sum(out.values()), "rest": ms["none of the four"], "full": full}


def ablation_table(r: dict) -> list[str]:
    lines = [
        "| bundle | cache positions | full step ms | GroupQueryAttention | norms | activation "
        "| head | the four, summed | step with all four out | its matrices alone (chain) "
        "| the rest beyond them | nodes (full / none of four) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for q, b in r["bundles"].items():
        chain = b["chain"]
        # the chain's step holds the head; the graph with all four out has none
        body = chain["step_ms"] - chain["roles"]["lm_head"]["ms"]
        for ctx, ms in b["ms"].items():
            c = costs(ms)
            lines.append(
                f"| {q} | {ctx} | {c['full']:.2f} | "
                + " | ".join(f"{c[p]:.2f}" for p in PARTS)
                + f" | {c['sum']:.2f} | {c['rest']:.2f} | {body:.2f} | {c['rest'] - body:.2f} | "
                f"{b['nodes']['full']} / {b['nodes']['none of the four']} |"
            )
    return lines


def flash_table(r: dict) -> list[str]:
    lines = [
        "| bundle | ORT_GQA_DISABLE_FLASH_ATTENTION | "
        + " | ".join(f"prefill {n} ms" for n in r["bundles"]["int4"]["flash"]["0"]["prefill_ms"])
        + " | "
        + " | ".join(f"decode at {c} ms" for c in r["bundles"]["int4"]["flash"]["0"]["decode_ms"])
        + " |",
        "|---|---|" + "---:|" * (len(r["contexts"]) + 2),
    ]
    for q, b in r["bundles"].items():
        for setting, f in b["flash"].items():
            cells = [f"{v:.1f}" for v in f["prefill_ms"].values()]
            cells += [f"{v:.2f}" for v in f["decode_ms"].values()]
            lines.append(f"| {q} | {setting} | " + " | ".join(cells) + " |")
    return lines


def flash_reading(r: dict) -> str:
    """Which setting is faster where, from the figures (ratio 1 over 0)."""
    parts = []
    for q, b in r["bundles"].items():
        on, off = b["flash"]["0"], b["flash"]["1"]
        cells = [
            f"prefill {n} {off['prefill_ms'][n] / v:.2f}×" for n, v in on["prefill_ms"].items()
        ]
        cells += [
            f"decode at {c} {off['decode_ms'][c] / v:.2f}×" for c, v in on["decode_ms"].items()
        ]
        parts.append(f"{q}: " + ", ".join(cells))
    return (
        "Time with flash attention disabled over time with it on (above 1: the default, flash "
        "attention on, is faster): " + "; ".join(parts) + "."
    )


def markdown(r: dict) -> str:
    bw, cfg = r["bandwidth"], r["config"]
    lines = [
        f"# A decode token's parts, unprofiled: {r['model']} ({r['weights']} weights), {r['date']}",
        "",
        f"{cpu_line(r['cpu'])} {r['machine']}; {r['threads']} threads. Made by "
        "`benchmarks/probes/probe_ablation.py`.",
        "",
        f"Model: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP "
        f"{cfg['intermediate_size']}, heads {cfg['num_attention_heads']}/"
        f"{cfg['num_key_value_heads']}, vocabulary {cfg['vocab_size']}.",
        "",
        f"Machine load: {r['load_start']:.1f} at the start, {r.get('machine_load', 'not noted')}. "
        "Foreign CPU seconds (other processes) during the ablation / A/B: "
        + ", ".join(
            f"{q} {b['foreign_cpu_s']:.0f} / {b['flash_foreign_cpu_s']:.0f}"
            for q, b in r["bundles"].items()
        )
        + ".",
        "",
        "## Each part's milliseconds a token",
        "",
        f"One-token decode steps after a cache of each length, {r['steps']} steps, best of "
        f"{r['rounds']} interleaved rounds; a part's cost is the full step minus the step with "
        "that part replaced by a pass-through of its shape. The matrices alone are "
        "probe_chain's sum over a step's calls without the head (below); the rest beyond them is "
        "the embedding row, the mask's nodes, binding and each node's dispatch.",
        "",
        *ablation_table(r),
        "",
        "## MatMulNBits alone, one shape at a time (one row)",
        "",
    ]
    for q, b in r["bundles"].items():
        lines += [f"### {q}", "", *probe_chain.table(b["chain"], bw["read_gb_s"]), ""]
    lines += [
        "Each matrix repeated with random weights of its format (at least as many copies as "
        "layers, and at least four times the last-level cache of "
        f"{r['bundles']['int4']['chain']['llc_bytes'] / 2**20:.0f} MiB), one input row.",
        "",
        "## ORT_GQA_DISABLE_FLASH_ATTENTION, A/B",
        "",
        "The engine (serve/core/engine.py) in its own process per setting, "
        "best of 2 processes each.",
        "",
        *flash_table(r),
        "",
        flash_reading(r),
        "",
        "## Read bandwidth",
        "",
        f"{bw['threads']} threads over {bw['array_mib']} MiB: {bw['method']} "
        f"{bw['read_gb_s']:.1f} GB/s at the start, {r['bandwidth_end']['read_gb_s']:.1f} at the "
        f"end (copy {bw['copy_gb_s']:.1f}); the numpy float32 sum that was the probe before "
        f"issue 57 read {bw['numpy_sum_gb_s']:.1f} and {r['bandwidth_end']['numpy_sum_gb_s']:.1f}.",
        "",
    ]
    return "\n".join(lines)
