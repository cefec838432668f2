"""bench_spec.py's report: the draft-length table, the servers' table and the figure."""

from __future__ import annotations

import math

from benchmarks.common import report

OFF = {"doel-serve": "doel-serve, no drafts", "llama-server": "llama-server, no drafts"}
DRAFTING = {
    "doel-serve, default": "doel-serve",
    "llama-server, ngram-simple": "llama-server",
    "llama-server, ngram-simple 3/6": "llama-server",
}


def _kept(r: dict) -> str:
    return f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "none drafted"


def _row(rows: list[dict], **want) -> dict | None:
    return next((r for r in rows if all(r[k] == v for k, v in want.items())), None)


def sweep_table(result: dict) -> list[str]:
    rows, tasks = result["sweep"], list(result["requests"])
    drafts = sorted({r["draft_tokens"] for r in rows})
    lines = [
        "| request | " + " | ".join(f"draft {d}" for d in drafts) + " |",
        "|---|" + "---:|" * len(drafts),
    ]
    for task in tasks:
        base = _row(rows, task=task, draft_tokens=0)["tok_s"]
        cells = []
        for d in drafts:
            r = _row(rows, task=task, draft_tokens=d)
            cell = f"{r['tok_s']:.0f}"
            if d:
                up = r["tok_s"] / base
                cell += f" (**{up:.2f}×**, kept {_kept(r)}, same {r['same']}/{r['of']})"
            cells.append(cell)
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines


def best_length(result: dict) -> tuple[int, float]:
    """The draft length with the highest geometric mean of its speed-ups over the kinds of
    request, and that mean."""
    rows = result["sweep"]
    means = {}
    for d in sorted({r["draft_tokens"] for r in rows} - {0}):
        ups = [_row(rows, task=t, draft_tokens=d)["tok_s"] / _row(rows, task=t, draft_tokens=0)
               ["tok_s"] for t in result["requests"]]  # fmt: skip
        means[d] = math.prod(ups) ** (1 / len(ups))
    d = max(means, key=means.get)
    return d, means[d]


def _same(a: dict, b: dict) -> str:
    return f"{sum(x == y for x, y in zip(a['texts'], b['texts']))}/{len(a['texts'])}"


def servers_table(result: dict, clients: int) -> list[str]:
    rows = [r for r in result["servers"] if r["clients"] == clients]
    runs = [r for r in result["server_runs"] if r["clients"] == clients]
    names = list(dict.fromkeys(r["server"] for r in rows))
    lines = [
        "| request | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for task in result["requests"]:
        cells = []
        for name in names:
            r = _row(rows, server=name, task=task)
            each = [x["tok_s"] for x in runs if x["server"] == name and x["task"] == task]
            cell = f"{r['tok_s']:.0f} [{min(each):.0f}-{max(each):.0f}]"
            if name in DRAFTING:
                off = _row(rows, server=OFF[DRAFTING[name]], task=task)
                cell += f" (**{r['tok_s'] / off['tok_s']:.2f}×**, kept {_kept(r)}, "
                cell += f"same {_same(r, off)})"
            if r["errors"]:
                cell += f", {r['errors']} errors"
            cells.append(cell)
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines


def against_llama(result: dict, clients: int) -> str:
    """doel-serve's default against llama-server's best, each request kind."""
    rows = [r for r in result["servers"] if r["clients"] == clients]
    parts = []
    for task in result["requests"]:
        ours = _row(rows, server="doel-serve, default", task=task)
        peer = max((r for r in rows if r["server"].startswith("llama") and r["task"] == task),
                   key=lambda r: r["tok_s"])  # fmt: skip
        parts.append(f"{task} {ours['tok_s'] / peer['tok_s']:.2f}×")
    return ", ".join(parts)


def _run(what: str, run: dict) -> str:
    return (f"{what} on {run['date']} ({run['machine_load']}, foreign CPU "
            f"{run['foreign_cpu_s']:.1f} s of {run['wall_s']:.0f} s)")  # fmt: skip


def markdown(result: dict) -> str:
    title = "Prompt-lookup drafting, SmolLM2-135M-Instruct"
    lines = [
        *report.heading(title, result),
        f"{report.cpu_line(result['cpu'])} {result['model']}; greedy chat completions of up "
        f"to {result['new_tokens']} ids, {result['one_client']} requests of each kind in turn "
        f"with one client; with eight, each client sends {result['each']} of the "
        f"{result['per_task']} in turn (the requests are in the JSON).",
        "",
        f"Measured in two parts: {_run('the draft lengths', result['sweep_run'])}; "
        f"{_run('the servers', result['servers_run'])}.",
        "",
        "## Draft length: doel's scheduler, one client, in process",
        "",
        "Output ids per second (prompt included), the speed-up over no drafting, the draft ids "
        "kept of those verified, and the replies whose ids equal those of no drafting. The "
        "lengths take turns on each request, each request's best of "
        f"{result['sweep_rounds']}.",
        "",
        *sweep_table(result),
        "",
        "The length with the highest geometric mean of the speed-ups: **{}** ({:.2f}×).".format(
            *best_length(result)
        ),
        "",
    ]
    for clients in (1, 8):
        lines += [
            f"## The servers, {clients} client{'s' if clients > 1 else ''} "
            f"(best of {result['processes']} process{'es' if result['processes'] > 1 else ''})",
            "",
            "Aggregate output ids per second of the best process [the slowest-fastest of "
            "all]; beside each drafting server its speed-up over the same server without "
            "drafts, the draft ids kept, and the replies equal to its undrafted ones.",
            "",
            *servers_table(result, clients),
            "",
            f"doel-serve at its default against llama-server's best of three: "
            f"{against_llama(result, clients)}.",
            "",
        ]
    return "\n".join(lines)


def figure(result: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["requests"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, clients in zip(axes, (1, 8)):
        rows = [r for r in result["servers"] if r["clients"] == clients]
        width = 0.8 / len(DRAFTING)
        for i, name in enumerate(DRAFTING):
            ups = []
            for task in tasks:
                r = _row(rows, server=name, task=task)
                off = _row(rows, server=OFF[DRAFTING[name]], task=task)
                ups.append(r["tok_s"] / off["tok_s"])
            ax.bar([x + i * width for x in range(len(tasks))], ups, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width for x in range(len(tasks))], tasks, rotation=20)
        ax.set_title(f"{clients} client{'s' if clients > 1 else ''}")
    axes[0].set_ylabel("speed-up over the same server without drafts")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Prompt-lookup drafting, SmolLM2-135M-Instruct ({result['cpu']['class']})")
    fig.tight_layout()
    return fig
