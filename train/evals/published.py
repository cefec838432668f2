"""Published zero-shot results of small models on the TituLLM suite's Bangla sets, and a table
that sets a doel model's own result beside them, each with its standard error and the set's
chance level, so a reader sees at once whether a difference is noise.

Source: the suite and its protocol are TituLLMs' (Nahin et al., 2025, "TituLLMs: A Family of
Bangla LLMs with Comprehensive Benchmarking", arXiv:2502.11187; lm-evaluation-harness, 0-shot,
hishab-nlp's task yamls). The figures are those listed for Llama-3.2-1B and Qwen2.5-0.5B in
huggingface.co/Polygl0t/LilTii-v0.1 `evals_for_reference.csv` (the paper's own tables were not
available to check them against). That file gives fractions, not counts: each is stored here as
correct/items, the counts that reproduce the listed fraction exactly with the set's size (BoolQ-BN
validation 432, CommonsenseQA-BN validation 1,221, OpenBookQA-BN test 497, PIQA-BN validation
1,838). For Bangla MMLU the smallest size that fits both fractions is 14,750; its set is larger
or equal, so the standard error given for it is an upper bound. Nor does the file say acc or
acc_norm: doel's acc is set beside them (acc_norm is in the task table).
"""

from __future__ import annotations

import math

SOURCE = (
    "TituLLMs suite and protocol (Nahin et al., 2025, arXiv:2502.11187; 0-shot); figures as "
    "listed in huggingface.co/Polygl0t/LilTii-v0.1 evals_for_reference.csv"
)
# task name (as in recipe.toml) -> (label, chance, {model: (correct, items)})
BASELINES = {
    "bangla_mmlu": (
        "Bangla MMLU",
        0.25,
        {"Llama-3.2-1B": (4155, 14750), "Qwen2.5-0.5B": (4549, 14750)},
    ),
    "boolq_bn": ("BoolQ-BN", 0.5, {"Llama-3.2-1B": (245, 432), "Qwen2.5-0.5B": (250, 432)}),
    "commonsenseqa_bn": (
        "CommonsenseQA-BN",
        0.2,
        {"Llama-3.2-1B": (284, 1221), "Qwen2.5-0.5B": (270, 1221)},
    ),
    "openbookqa_bn": (
        "OpenBookQA-BN",
        0.25,
        {"Llama-3.2-1B": (158, 497), "Qwen2.5-0.5B": (152, 497)},
    ),
    "piqa_bn": ("PIQA-BN", 0.5, {"Llama-3.2-1B": (972, 1838), "Qwen2.5-0.5B": (985, 1838)}),
}
MODELS = ("Llama-3.2-1B", "Qwen2.5-0.5B")


def binomial_stderr(correct: int, items: int) -> float:
    """sqrt(p(1-p)/n): what the bootstrap standard error of doel's own figures estimates."""
    p = correct / items
    return math.sqrt(p * (1 - p) / items)


def _cell(acc: float, se: float | None) -> str:
    return f"{acc:.3f}" + (f" ± {se:.3f}" if se is not None and math.isfinite(se) else "")


def _doel_cell(r: dict | None) -> str:
    if not r or not r.get("items"):
        return "not scored"
    return f"{_cell(r['acc'], r.get('acc_stderr'))} ({r['items']:,} items)"


def comparison_table(results: dict[str, dict] | None, who: str = "doel (this model)") -> str:
    """A Markdown table: each set's chance, the published baselines and `who`'s acc, all ±
    one standard error; a set not scored says so instead of a number."""
    results = results or {}
    head = f"| set | chance | {' | '.join(MODELS)} | {who} |"
    lines = [head, "|---|---:|" + "---:|" * (len(MODELS) + 1)]
    for task, (label, chance, published) in BASELINES.items():
        cells = [_cell(c / n, binomial_stderr(c, n)) for c, n in (published[m] for m in MODELS)]
        lines.append(
            f"| {label} (`{task}`) | {chance:.2f} | {' | '.join(cells)} "
            f"| {_doel_cell(results.get(task))} |"
        )
    return "\n".join(lines)


def comparison_section(results: dict[str, dict] | None) -> list[str]:
    """The table with what it rests on, for the model card."""
    return [
        "Beside published small models on the TituLLM Bangla sets (accuracy ± standard error; "
        f"{SOURCE}; their standard errors are sqrt(p(1-p)/n), doel's bootstrap):",
        "",
        comparison_table(results),
        "",
        "A difference within about two standard errors of both figures is noise. doel scores "
        "the first eval.task_limit items of a set (the count is shown); the baselines scored "
        "whole splits.",
    ]
