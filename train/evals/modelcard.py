"""The model card: README.md in a model folder, with the Hugging Face metadata block (language,
license, library_name, tags, pipeline_tag, model-index) and what a reader needs to trust the
weights: architecture and size, the tokenizer's fertility per script, the training data mix in
characters and tokens, tokens seen, hardware, time and cost, and the evaluation.

Everything is read from files the other stages write (config.json, tokenizer.json,
train_config.json, model.safetensors' header) or passed in; a section whose input is missing
says so instead of guessing, and a figure that cannot be computed reads "n/a", never "nan".
Fertility is measured on the built-in sample (train/sample/), so every card reports it on the
same text.

What was passed in is kept next to the card (model_card.json), so that `doel-train eval` can
write the card again with its results (`refresh_model_card`) without knowing how the model was
trained.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from doel.contracts import read_json
from doel.contracts.card import REPO_ID, front_matter, yaml_str
from doel.train.common import SAMPLE_DIR, atomic_write_bytes, atomic_write_json
from doel.train.data.fertility import fertility, load_any
from doel.train.data.textio import iter_documents
from doel.train.evals.cardeval import card_eval, merge, texts_cell
from doel.train.evals.published import BASELINES, comparison_section
from doel.train.evals.scoring import fmt_num, format_tasks
from doel.train.evals.usage import check_repo_id, usage_path, usage_section
from doel.train.metrics import format_duration

SAMPLE = SAMPLE_DIR
CARD_INPUTS = "model_card.json"  # what README.md was written from
TASK_NAMES = {
    "hellaswag": "HellaSwag",
    "piqa": "PIQA",
    "arc_easy": "ARC-Easy",
    "arc_challenge": "ARC-Challenge",
    "winogrande": "WinoGrande",
    "copa": "COPA",
    "openbook_qa": "OpenBookQA",
    "commonsense_qa": "CommonsenseQA",
    "siqa": "SocialIQA",
    "boolq": "BoolQ",
    "bn_tydiqa": "TyDi QA GoldP Bengali (4-way)",
    "bn_blanck": "BLanCK (4-way)",
    **{task: f"{label} (TituLLM suite)" for task, (label, _, _) in BASELINES.items()},
}


def stored_parameters(folder: Path) -> int:
    """Parameters in model.safetensors, from its header alone (a tied matrix is stored once)."""
    with open(folder / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, t in header.items():
        if name != "__metadata__":
            size = 1
            for d in t["shape"]:
                size *= d
            total += size
    return total


def metadata_block(name: str, license: str, eval_result: dict | None) -> list[str]:
    """The YAML front matter; model-index holds the task accuracies when there are any."""
    tags = ["doel", "llama", "bangla", "text-generation"]
    return front_matter("transformers", license, tags, more=model_index(name, eval_result))


def model_index(name: str, eval_result: dict | None) -> list[str]:
    """The metadata's model-index: each task's accuracies, the Hub's evaluation results."""
    lines: list[str] = []
    tasks = (eval_result or {}).get("tasks") or {}
    # A task with no items has no accuracy: it is left out, never written as "nan".
    tasks = {t: r for t, r in tasks.items() if math.isfinite(r["acc"])}
    if tasks:
        lines += ["model-index:", f"- name: {yaml_str(name)}", "  results:"]
        for task, r in tasks.items():
            lines += [
                "  - task:",
                "      type: text-generation",
                "    dataset:",
                f"      name: {yaml_str(TASK_NAMES.get(task, task))}",
                f"      type: {yaml_str(task)}",
                "    metrics:",
                f'    - {{type: acc, value: {r["acc"]:.4f}, name: "accuracy, 0-shot"}}',
                f'    - {{type: acc_norm, value: {r["acc_norm"]:.4f}, name: "acc_norm, 0-shot"}}',
            ]
    return lines


def architecture_section(folder: Path) -> list[str]:
    cfg = read_json(folder / "config.json", strict=True) or {}
    rows = [
        ("parameters (stored, tied once)", f"{stored_parameters(folder):,}"),
        ("layers", cfg.get("num_hidden_layers")),
        ("hidden size", cfg.get("hidden_size")),
        ("MLP size (SwiGLU)", cfg.get("intermediate_size")),
        (
            "query / key-value heads",
            f"{cfg.get('num_attention_heads')} / {cfg.get('num_key_value_heads')}",
        ),
        ("context (tokens)", cfg.get("max_position_embeddings")),
        ("vocabulary", f"{cfg.get('vocab_size', 0):,}"),
        ("tied embeddings", cfg.get("tie_word_embeddings")),
        ("rotary theta", cfg.get("rope_theta")),
    ]
    rows = [(k, v) for k, v in rows if v is not None and "None" not in str(v)]
    return [
        "## Architecture",
        "",
        "Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU); loads in "
        "`transformers.LlamaForCausalLM` unchanged.",
        "",
        "| | |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in rows),
    ]


def tokenizer_section(folder: Path) -> list[str]:

    if not (folder / "tokenizer.json").is_file():
        return ["## Tokenizer", "", "No tokenizer.json in the folder."]
    texts = [d for p in sorted(SAMPLE.glob("*.txt")) for d in iter_documents(str(p))]
    report = fertility(load_any(folder / "tokenizer.json"), texts)
    lines = [
        "## Tokenizer",
        "",
        "Byte-fallback BPE that keeps Bengali combining marks inside words; every document starts "
        "with `<|bos|>`. Fertility on doel's built-in Bangla + English sample:",
        "",
        "| script | characters | tokens | chars/token | tokens/word | byte fallback |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for script, r in report.items():
        lines.append(
            f"| {script} | {r['characters']:,} | {r['tokens']:,} | {r['chars_per_token']:.2f} "
            f"| {r['tokens_per_word']:.2f} | {r['byte_fallback_rate']:.2%} |"
        )
    return lines


def data_section(meta: dict | None) -> list[str]:
    """The training split's mix per source: characters and tokens, and their shares."""
    if not meta or not meta.get("sources"):
        return ["## Training data", "", "Not recorded (no shards meta.json was given)."]
    every = meta["sources"]
    chars = {k: s.get("train_characters", s.get("characters", 0)) for k, s in every.items()}
    toks = {k: s.get("train_tokens", s.get("tokens", 0)) for k, s in every.items()}
    # A source given as validation text only has no training characters: no row, one line.
    src = [k for k in every if chars[k] or toks[k]]
    held = [k for k in every if k not in src]
    tc, tt = max(sum(chars.values()), 1), max(sum(toks.values()), 1)
    lines = [
        "## Training data",
        "",
        "Training split per source (validation documents excluded):",
        "",
        "| source | characters | share | tokens | share | chars/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k in src:
        cpt = fmt_num(chars[k] / toks[k] if toks[k] else None, ".2f")
        lines.append(
            f"| {k} | {chars[k]:,} | {chars[k] / tc:.1%} | {toks[k]:,} | {toks[k] / tt:.1%} "
            f"| {cpt} |"
        )
    lines.append(f"| **total** | {tc:,} | 100% | {tt:,} | 100% | {tc / tt:.2f} |")
    if held:
        lines += ["", f"Validation only (not trained on): {', '.join(held)}."]
    return lines


def training_section(
    folder, train_state, hardware, seconds, hourly_price, attempts: int = 1, devices: int = 1
) -> list[str]:
    """Steps, tokens, the main settings, hardware, and the time and cost of every attempt (a
    resumed run paid for each, the steps it redid included)."""

    cfg = (
        (train_state or {}).get("config")
        or read_json(folder / "train_config.json", strict=True)
        or {}
    )
    rows = []
    if train_state:
        rows += [("steps", f"{train_state.get('step', 0):,}")]
        rows += [("tokens seen", f"{train_state.get('tokens_seen', 0):,}")]
    for key in ("seq_len", "batch_size", "grad_accum", "lr", "schedule", "dtype"):
        if key in cfg:
            rows.append((key, cfg[key]))
    rows.append(("hardware", hardware or "not recorded"))
    if seconds is None:
        rows.append(("time", "not recorded"))
    else:
        resumed = f" over {attempts} attempts (resumed runs)" if attempts > 1 else ""
        rows.append(("time", format_duration(seconds) + resumed))
    if seconds is not None and hourly_price:
        cost = seconds / 3600 * hourly_price * devices
        each = f" × {devices} devices" if devices > 1 else ""
        rows.append(("estimated cost", f"${cost:,.2f} (at ${hourly_price:g}/hour{each})"))
    return ["## Training", "", "| | |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, the first column left-aligned and the figures right-aligned."""
    rule = "|---" + "|---:" * (len(head) - 1) + "|"
    return [f"| {' | '.join(head)} |", rule, *(f"| {' | '.join(row)} |" for row in rows)]


def evaluation_section(eval_result: dict | None, where: str = "FOLDER") -> list[str]:
    if not eval_result:
        return [
            "## Evaluation",
            "",
            f"Not evaluated yet: `doel-train eval {where} --text FILES` measures it and writes "
            "this card again with the results.",
        ]
    lines = ["## Evaluation", ""]
    if eval_result.get("languages"):
        rows = [
            [r.get("language", lang), f"{r['model']['chars']:,}"]
            + [fmt_num(x, ".3f") for x in (r["model"]["bits_per_char"], r["twin"]["bits_per_char"])]
            + [fmt_num(r["compressors"][c], ".3f") for c in ("xz -9e", "bzip2 -9")]
            + [texts_cell(r)]
            for lang, r in eval_result["languages"].items()
        ]
        head = ["language", "characters", "bits/char", "twin", "xz -9e", "bzip2 -9", "texts"]
        intro = "Held-out bits per character (lower is better), against a random-initialised "
        lines += [intro + "twin and general-purpose compressors:", "", *_table(head, rows), ""]
    if eval_result.get("tasks"):
        lines += [
            "Zero-shot multiple choice by log-likelihood (± bootstrap standard error; acc_norm "
            "divides by the choice's characters):",
            "",
            format_tasks(eval_result["tasks"]),
            "",
        ]
    return lines + comparison_section(eval_result.get("tasks"))


def _summary_line(finetune: dict | None) -> str:
    if not finetune:
        return "A Bangla-first language model trained with doel."
    return (
        f"A Bangla-first chat model: `{finetune['base_model']}` fine-tuned with doel "
        "(`doel-train sft`) on conversations."
    )


def finetune_section(ft: dict) -> list[str]:
    """What a chat model was fine-tuned from and on, and how its chat is written."""
    stats = ft.get("stats") or {}
    lines = [
        "## Chat fine-tuning",
        "",
        f"- Base model: `{ft['base_model']}`"
        + (f" ({ft['base_repo']})" if ft.get("base_repo") else "")
        + (f", weights sha256 `{ft['base_sha256']}`" if ft.get("base_sha256") else ""),
        f"- Data: {', '.join(f'`{d}`' for d in ft.get('data', []))}",
    ]
    if stats:
        lines.append(
            f"- {stats.get('conversations', 0):,} conversations ({stats.get('train', 0):,} trained "
            f"on, {stats.get('heldout', 0):,} held out), {stats.get('assistant_tokens', 0):,} "
            f"assistant tokens; {stats.get('truncated', 0):,} truncated to the context, "
            f"{stats.get('dropped', 0):,} dropped"
        )
        for name, n in (stats.get("sources") or {}).items():
            lines.append(f"  - `{name}`: {n:,} conversations")
    lines += [
        "- Loss on the assistant's tokens only (each reply and its closing `<|end|>`), one "
        "conversation a padded row",
        "- Chat template (`tokenizer_config.json`): `<|bos|>`, then `<|role|>content<|end|>` a "
        "message, `<|assistant|>` to ask for a reply; the model ends a reply with `<|end|>`",
    ]
    return lines


def write_model_card(
    folder: str | Path,
    *,
    meta: dict | None = None,
    train_state: dict | None = None,
    eval_result: dict | None = None,
    hardware: str | None = None,
    seconds: float | None = None,
    attempts: int = 1,
    devices: int = 1,
    hourly_price: float | None = None,
    license: str = "apache-2.0",
    repo_id: str | None = None,
    finetune: dict | None = None,
) -> Path:
    """Write FOLDER/README.md, and FOLDER/model_card.json with what it was written from.
    meta: the shards' meta.json; train_state: {"step", "tokens_seen", "config"}
    (trainer_state.json); eval_result: `evaluate_checkpoint`'s dict; seconds of training over
    `attempts` attempts on `devices` devices at hourly_price dollars a device-hour give the
    cost. repo_id: the model's Hugging Face repository, for the usage example; None keeps the one
    an earlier card of this folder recorded. finetune: a chat fine-tuning's base model and data
    (train/sft.py); `meta` is then the base model's pre-training data."""
    folder = Path(folder)
    if repo_id is None:
        earlier = (read_json(folder / CARD_INPUTS, strict=True) or {}).get("repo_id")
        repo_id = earlier if isinstance(earlier, str) and REPO_ID.fullmatch(earlier) else None
    else:
        check_repo_id(repo_id)
    inputs = {
        "meta": {"sources": meta["sources"]} if meta and meta.get("sources") else None,
        "train_state": train_state,
        "eval_result": card_eval(eval_result),
        "hardware": hardware,
        "seconds": seconds,
        "attempts": attempts,
        "devices": devices,
        "hourly_price": hourly_price,
        "license": license,
        "repo_id": repo_id,
        "finetune": finetune,
    }
    name = folder.resolve().name if folder.name != "final" else folder.resolve().parent.name
    where = usage_path(folder)
    ev = inputs["eval_result"]
    parts = [
        metadata_block(name, license, ev),
        [f"# {name}", "", _summary_line(finetune)],
        architecture_section(folder),
        tokenizer_section(folder),
        *([finetune_section(finetune)] if finetune else []),
        data_section(inputs["meta"]),
        training_section(folder, train_state, hardware, seconds, hourly_price, attempts, devices),
        evaluation_section(ev, where),
        usage_section(folder, name, repo_id),
    ]
    path = folder / "README.md"
    atomic_write_bytes(path, ("\n\n".join("\n".join(p) for p in parts) + "\n").encode("utf-8"))
    atomic_write_json(folder / CARD_INPUTS, inputs)
    return path


def refresh_model_card(
    folder: str | Path, eval_result: dict, repo_id: str | None = None
) -> Path | None:
    """Write the card of a folder again with an evaluation (and a repository id, if given),
    everything else as it was written (model_card.json). The evaluation's rows join the card's
    earlier ones (cardeval.merge: rows for other texts stay). None, and nothing written, for a
    folder without doel's card."""
    folder = Path(folder)
    inputs = read_json(folder / CARD_INPUTS, strict=True)
    if inputs is None:
        return None
    ev = merge(inputs.get("eval_result"), card_eval(eval_result))
    given = {"eval_result": ev} | ({"repo_id": repo_id} if repo_id else {})
    return write_model_card(folder, **(inputs | given))
