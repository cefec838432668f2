"""The serving benchmark's report: Markdown tables and a PNG from bench_serve.py's result, the
CPU class it ran on named in both."""

from __future__ import annotations

LABELS = {
    "doel": "doel engine",
    "llama.cpp": "llama.cpp",
    "llama.cpp+fa": "llama.cpp, flash attn",
    "torch": "PyTorch eager",
}


def _f(v, fmt: str, missing: str = "–") -> str:
    return missing if v is None else format(v, fmt)


def streams_ratio(sweep: dict) -> float | None:
    """Aggregate tokens/s of 8 streams over one in a sweep; None where either is missing."""
    points = {pt["streams"]: pt["aggregate_tok_s"] for pt in sweep.get("points", [])}
    return points[8] / points[1] if 8 in points and 1 in points else None


def verdict(t: dict) -> str:
    return {True: "met", False: "**NOT met**", None: "not measured"}[t["met"]]


def engine_table(result: dict) -> list[str]:
    p = result["settings"]
    return [
        f"| engine | variant | time to first token, {p['short']} / {p['long']} tokens (s) | "
        f"decode tok/s after {p['short']} / {p['long']} | peak RSS MB | load s | "
        "decode / bandwidth bound, short / long | foreign CPU s (of row s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *map(engine_row, result["rows"]),
    ]


def engine_row(r: dict) -> str:
    """An engine's row; one that did not run says why in its first line, the rest left empty."""
    name = LABELS[r["engine"]]
    if "short" not in r:
        why = r.get("missing") or r.get("error", "failed")
        return f"| {name} | {r['variant']} | missing: {why.splitlines()[0]} ||||||"
    s, lo = r["short"], r["long"]
    flag = " **busy**" if r["busy"] else ""
    return (
        f"| {name} | {r['variant']} | {s['ttft_s']:.3g} / {lo['ttft_s']:.3g} | "
        f"**{s['decode_tok_s']:.1f}** / {lo['decode_tok_s']:.1f} | {r['peak_rss_mb']:.0f} | "
        f"{r['load_s']:.1f} | {r['short_fraction_of_bound']:.0%} / "
        f"{r['long_fraction_of_bound']:.0%} | {r['foreign_cpu_s']:.0f} "
        f"({r['row_wall_s']:.0f}){flag} |"
    )


def bound_table(result: dict) -> list[str]:
    """One row per file (its engines share it): the first row that measured each variant."""
    files = {}
    for r in result["rows"]:
        if "short_bound_tok_s" in r:
            files.setdefault(r["variant"], r)
    return [
        "| variant | weights MB (embedding MB) | bytes read per token, short / long (MB) | "
        "bound tok/s, short / long | tensor types |",
        "|---|---:|---:|---:|---|",
        *(
            f"| {r['variant']} | {r['weight_bytes'] / 1e6:.0f} ({r['embedding_bytes'] / 1e6:.0f}) "
            f"| {r['short_bytes_per_token'] / 1e6:.0f} / {r['long_bytes_per_token'] / 1e6:.0f} | "
            f"{r['short_bound_tok_s']:.1f} / {r['long_bound_tok_s']:.1f} | "
            f"{', '.join(r.get('tensor_types') or []) or '–'} |"
            for r in files.values()
        ),
    ]


def sweep_table(sw: dict) -> list[str]:
    if "points" not in sw:
        return [f"Sweep failed: {sw.get('error', '?')}"]
    lines = [
        "| streams | requests | aggregate tok/s | × one stream | decode phase tok/s | × one "
        "stream | p50 latency s | p95 latency s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    one = sw["points"][0]
    for pt in sw["points"]:
        lines.append(
            f"| {pt['streams']} | {pt['requests']} | {pt['aggregate_tok_s']:.1f} | "
            f"{pt['aggregate_tok_s'] / one['aggregate_tok_s']:.2f} | "
            f"{pt['decode_phase_tok_s']:.1f} | "
            f"{pt['decode_phase_tok_s'] / one['decode_phase_tok_s']:.2f} | "
            f"{pt['p50_latency_s']:.2f} | {pt['p95_latency_s']:.2f} |"
        )
    flag = " **busy**" if sw["busy"] else ""
    lines += [
        "",
        f"Foreign CPU during the sweep: {sw['foreign_cpu_s']:.0f} s of "
        f"{sw['row_wall_s']:.0f} s{flag}; peak RSS {sw['peak_rss_mb']:.0f} MB.",
    ]
    return lines


def cpu_line(cpu: dict | None) -> str:
    """The CPU the run measured (results from before it was recorded say so)."""
    if cpu is None:
        return "CPU: not recorded by this run."
    have = [name for name, on in cpu["isa"].items() if on]
    return (
        f"CPU: {cpu['model_name']}, class **{cpu['class']}** (ISA extensions present: "
        f"{', '.join(have) or 'none of those checked'}; absent: "
        f"{', '.join(n for n, on in cpu['isa'].items() if not on) or 'none'})."
    )


def markdown(result: dict) -> str:
    p, m, bw = result["settings"], result["model"], result["bandwidth"]
    busy = [r["variant"] for r in result["rows"] if r.get("busy")]
    busy += [f"sweep {v}" for v, sw in result["sweeps"].items() if sw.get("busy")]
    lines = [
        f"# Serving benchmark, {p['preset']} ({p.get('weights', 'random')} weights) "
        f"({result['date']}, "
        f"{result['machine']})",
        "",
        f"Model: {model_source(p)}, {result['parameters_m']:.1f}M parameters "
        f"(vocabulary {m['vocab_size']}, {m['num_hidden_layers']} layers, hidden "
        f"{m['hidden_size']}, {m['num_attention_heads']}/{m['num_key_value_heads']} heads). "
        f"{p['threads']} threads everywhere; greedy, batch 1, {p['new_tokens']} new tokens after "
        f"each prompt; best of {p['repeats']['short']} ({p['short']} tokens) and "
        f"{p['repeats']['long']} ({p['long']} tokens) runs in each of {p.get('processes', 1)} "
        "processes per engine (a process's memory reads run faster or slower for its whole "
        "life, and a one-row decode moves with them)"
        + ("; the engines take turns, one process each a round. " if p.get("interleaved") else ". ")
        + f"llama.cpp: context {p['n_ctx']}, flash attention off and on (each target takes the "
        f"better); our engine: one slot of {p['n_ctx']} positions, its KV cache "
        f"{p.get('kv_cache', 'fp32')} (llama.cpp's: f16).",
        "",
        cpu_line(result.get("cpu")),
        "",
    ]
    if busy:
        lines += [
            f"**Taken on a busy machine**: other processes used more than 5% of the CPU during "
            f"{', '.join(busy)} (foreign CPU column). Those speeds are not to be trusted; rerun "
            "`make bench-serve` on a quiet machine.",
            "",
        ]
    lines += [
        "## Targets (issue 5), ratios from this run",
        "",
        "| target | value | needed | verdict | llama.cpp row |",
        "|---|---:|---:|---|---|",
    ]
    for t in result["targets"]:
        lines.append(
            f"| {t['target']} | {_f(t['value'], '.2f')} | {t['op']} {t['threshold']:.2f} | "
            f"{verdict(t)} | {t.get('peer') or ''} |"
        )
    ratios = [
        f"{variant} {ratio:.2f}"
        for variant, sweep in result["sweeps"].items()
        if (ratio := streams_ratio(sweep)) is not None
        and not any("8 streams" in t["target"] for t in result["targets"])
    ]
    if ratios:
        lines += [
            "",
            f"Aggregate tokens/s of 8 streams over one: {', '.join(ratios)}. Not a target since "
            "issue 33: the multi-client targets are doel-serve against llama-server under the "
            "same HTTP load (`serve_load_<model>_cpu-<class>.md`); the profile's ceilings say how "
            "far batching can go on one CPU.",
        ]
    lines += ["", "## Engines", "", *engine_table(result), ""]
    lines += [
        f"Bandwidth bound: bytes read per decoded token (all weights but the embedding table, "
        f"of which one row, plus the KV cache at the run's mean context) over the read bandwidth "
        f"of a {bw['threads']}-thread {bw.get('method', 'numpy sum')} over "
        f"{bw.get('array_mib', 512)} MiB (benchmarks/probes/probe_stream.py) measured in this "
        f"run: {bw['read_gb_s']:.1f} GB/s "
        f"at the start, {result['bandwidth_end']['read_gb_s']:.1f} at the end (copy "
        f"{bw['copy_gb_s']:.1f} GB/s, read + write)"
        + (
            f"; the numpy sum that was the probe before issue 57 read {bw['numpy_sum_gb_s']:.1f}."
            if "numpy_sum_gb_s" in bw
            else "."
        ),
        "",
        *bound_table(result),
        *sweep_lines(result),
    ]
    info = result["llama_cpp"]
    if "missing" in info:
        lines += ["", "llama-cpp-python was not installed; to build it:", "", "```"]
        lines += [info["missing"], "```"]
    else:
        lines += ["", f"llama-cpp-python {info['version']}: `{info['system_info']}`"]
    return "\n".join(lines) + "\n"


def model_source(p: dict) -> str:
    """Where the run's model came from: a preset's config, or the imported model."""
    if p.get("weights", "random") == "random":
        return f"`configs/{p['preset']}.toml` [model]"
    return p["weights"]


def sweep_lines(result: dict) -> list[str]:
    """The sweeps' section (none in a --single-stream run)."""
    p = result["settings"]
    if not result["sweeps"]:
        return ["", "No concurrency sweeps in this run (`--single-stream`)."]
    lines = [
        "",
        f"## Concurrency sweeps (our engine, scheduler with {max(p['streams'])} slots)",
        "",
        f"Streams arrive together, each a {p['sweep_prompt']}-token prompt and "
        f"{p['sweep_new_tokens']} new tokens; aggregate = all new tokens over the wall time "
        "(the prompts' prefill included: the target is checked on it); decode phase = the "
        "tokens that came after the last stream's first token, over the time from then to the "
        "end (every prompt prefilled); latency = a request's arrival to its last token; one stream "
        f"alone is {p['single_stream_rounds']} requests in turn; each point is the best of "
        f"{p.get('processes', 1)} processes, each one pass over the stream counts. Every "
        "request has a prompt "
        "of its own, so none is found in a slot's cache: prompt tokens taken from the cache "
        + ", ".join(
            f"{v} {sum(q.get('cached_prompt_tokens', 0) for q in sw.get('points', []))}"
            for v, sw in result["sweeps"].items()
        )
        + ".",
    ]
    for variant, sw in result["sweeps"].items():
        lines += ["", f"### {variant}", "", *sweep_table(sw)]
    return lines


SHORT = {"doel": "doel", "llama.cpp": "llama.cpp", "llama.cpp+fa": "llama.cpp\nflash attn",
         "torch": "PyTorch"}  # fmt: skip


def figure(result: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "short" in r]
    p = result["settings"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    names = [f"{SHORT[r['engine']]}\n{r['variant']}" for r in rows]
    x = range(len(rows))
    for ax, key, title in (
        (axes[0], "decode_tok_s", "decode tokens/s (higher is better)"),
        (axes[1], "ttft_s", "time to first token, s, log scale (lower is better)"),
    ):
        w = 0.4
        for shift, name in ((-w / 2, "short"), (w / 2, "long")):
            values = [r[name][key] for r in rows]
            ax.bar([i + shift for i in x], values, w, label=f"{p[name]}-token prompt")
        ax.set_xticks(list(x), names, fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    for variant, sw in result["sweeps"].items():
        pts = sw.get("points", [])
        if not pts:
            continue
        streams = [q["streams"] for q in pts]
        line = axes[2].plot(streams, [q["aggregate_tok_s"] for q in pts], "o-", label=variant)
        axes[2].axhline(
            3 * pts[0]["aggregate_tok_s"], color=line[0].get_color(), lw=0.8, ls=":",
            label=f"3x one {variant} stream",
        )  # fmt: skip
        axes[2].set_xticks(streams)
        axes[2].legend(fontsize=8)
    axes[2].set_xlabel("concurrent streams")
    axes[2].set_title("our engine: aggregate tokens/s, end to end", fontsize=10)
    cpu = result.get("cpu", {}).get("class", "CPU class not recorded")
    fig.suptitle(f"Serving, {p['preset']}, {p['threads']} threads, {cpu} ({result['date']})")
    fig.tight_layout()
    fig.set_dpi(110)
    return fig  # written by report.publish
