"""Zero-shot tasks from local files in their standard formats, each item a list of (context,
continuation) requests of which one is right: HellaSwag (`ctx`/`endings`/`label`), PIQA
(`valid.jsonl` + `valid-labels.lst`), MosaicML's query/choices/gold and schema JSONL (ARC, BoolQ,
COPA, OpenBookQA, CommonsenseQA, SocialIQA, PIQA, WinoGrande, WSC), the TituLLM suite's Bangla
sets in their hub columns (JSONL or Parquet: Bangla MMLU, BoolQ-BN, CommonsenseQA-BN,
OpenBookQA-BN, PIQA-BN; fetched by train/evals/hubtasks.py), and two Bangla short-answer sets
turned into four-way choices (TyDi QA GoldP Bengali, BLanCK). Scoring: `train/evals/scoring.py`.

Prompts follow lm-evaluation-harness where it has the task (HellaSwag and PIQA are cross-checked
item by item against it) and llm-foundry's delimiters for its files. A choice's word-boundary
space belongs to the continuation (" is ripping level tiles off."), as in lm-eval.

The TituLLM sets are scored as the suite's own lm-eval tasks score them (hishab-nlp's fork of
lm-evaluation-harness, lm_eval/tasks/{bangla_mmlu,bnmmlu,boolq_bn,commonsenseqa_bn,
openbookqa_bn,piqa_bn}/*.yaml, read at commit abb4c0ec): the same prompts in English framing
("Question:", "Answer:"), the same choices, zero-shot. Their TituLLM results are 0-shot and
5-shot; doel scores 0-shot only.

Bangla short answers are scored by log-likelihood of the gold answer against three distractors,
not by exact match of a greedy answer: a small model almost never generates the exact span, so
EM/F1 would sit at zero and rank nothing, while the ranking separates models from early on.
TyDi QA distractors are spans of the same passage with the gold answer's word count (so copying
from the passage is not enough, the model has to pick the right span); BLanCK distractors are
other answers ("terms") of the same category. Both are drawn with a seed fixed per item.
"""

from __future__ import annotations

import csv
import json
import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from doel.train.common import DoelError

# llm-foundry's continuation delimiters for its files (its tasks yaml); " " for the rest. The
# trailing space of "\nAnswer: " moves to the choice, as lm-eval does with context spaces.
FOUNDRY_DELIMITERS = {
    "arc_easy": "\nAnswer:",
    "arc_challenge": "\nAnswer:",
    "boolq": "\nAnswer:",
    "piqa": "\nAnswer:",
}
BN_QUESTION, BN_ANSWER = "প্রশ্ন:", "উত্তর:"
BN_DISTRACTORS = 3
LETTERS = ("A", "B", "C", "D")
# Punctuation a passage span may carry at its edges, the danda (।) included.
SPAN_EDGES = " \t\n.,;:!?'\"()[]{}‘’“”—–-।॥"


@dataclass(frozen=True)
class Item:
    """One question: requests[i] = (context, continuation) of choice i; `gold` the right one;
    `lengths[i]` the characters acc_norm divides choice i's log-likelihood by (lm-eval's
    len(choice): the choice text without its leading delimiter)."""

    requests: tuple[tuple[str, str], ...]
    gold: int
    lengths: tuple[int, ...]

    @classmethod
    def choices(cls, context: str, choices: list[str], gold: int, delimiter: str = " ") -> Item:
        """The usual shape: one context, each choice a continuation after the delimiter."""
        if not 0 <= gold < len(choices):
            raise ValueError(f"gold {gold} is not an index into {len(choices)} choices")
        return cls(
            tuple((context, delimiter + c) for c in choices),
            gold,
            tuple(len(c) for c in choices),
        )


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DoelError(
                        f"{path}:{n}: not JSON ({e.msg}); expected JSON lines"
                    ) from None
    return rows


def _items(path: Path, docs: list, make) -> list[Item]:
    """make(doc) for every doc; a malformed one names the file and the item."""
    items = []
    for n, doc in enumerate(docs, 1):
        try:
            items.append(make(doc))
        except (KeyError, ValueError, TypeError, IndexError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise DoelError(
                f"{path}: item {n}: {what}; see train/evals/tasks.py for the formats"
            ) from None
    return items


def hellaswag_clean(text: str) -> str:
    """HellaSwag's WikiHow artifacts removed as lm-eval's hellaswag task does: strip, " [title]"
    becomes a full stop, other [bracketed] markers go, then one pass of double spaces to one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag_item(doc: dict) -> Item:
    """lm-eval's prompt: "activity: ctx_a Ctx_b"; files that carry only `ctx` (as the text
    reconstruction in ../shared/data does) use it unchanged, so ctx_b is not capitalised."""
    if "ctx_a" in doc:
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    else:
        ctx = doc["ctx"]
    query = hellaswag_clean(doc["activity_label"] + ": " + ctx)
    return Item.choices(query, [hellaswag_clean(e) for e in doc["endings"]], int(doc["label"]))


def piqa_item(doc: dict, label: int) -> Item:
    """lm-eval's piqa prompt."""
    return Item.choices(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], label)


def mmlu_bn_item(doc: dict) -> Item:
    """Bangla MMLU (hishab/bangla-mmlu: `choices`; hishab/titulm-bangla-mmlu: `options`), the
    suite's prompt: the question, the four options lettered A-D, "Answer:"; the choices are the
    letters. `answer` is the index (a ClassLabel) or the letter itself."""
    options = doc["options"] if "options" in doc else doc["choices"]
    if len(options) != 4:
        raise ValueError(f"expected 4 options, got {len(options)}")
    lines = [doc["question"].strip(), *(f"{k}. {o}" for k, o in zip(LETTERS, options))]
    answer = doc["answer"]
    gold = LETTERS.index(answer.strip()) if isinstance(answer, str) else int(answer)
    return Item.choices("\n".join(lines) + "\nAnswer:", list(LETTERS), gold)


def boolq_bn_item(doc: dict) -> Item:
    """BoolQ-BN (hishab/boolq_bn), boolq_bn.yaml's prompt: passage, "Question: {question}?"
    (the "?" added, as there), "Answer:" against " no" / " yes"; `answer` a bool."""
    answer = doc["answer"]
    if not isinstance(answer, (bool, int)) or answer not in (0, 1):
        raise ValueError(f"answer must be true or false, got {answer!r}")
    query = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    return Item.choices(query, ["no", "yes"], int(answer))


def stem_choices_item(doc: dict) -> Item:
    """CommonsenseQA-BN and OpenBookQA-BN (question_stem, choices {label, text}, answerKey):
    the stem alone as context, each choice's text a continuation, as their yaml does."""
    labels, texts = list(doc["choices"]["label"]), list(doc["choices"]["text"])
    return Item.choices(doc["question_stem"], texts, labels.index(doc["answerKey"].lstrip()))


def load_piqa(path: Path) -> list[Item]:
    """`valid.jsonl` + `valid-labels.lst` (a folder holding them, or the .jsonl with its
    labels file beside it), lines aligned."""
    jsonl = path / "valid.jsonl" if path.is_dir() else path
    labels = jsonl.with_name(jsonl.stem + "-labels.lst")
    if not labels.is_file():
        raise DoelError(f"{labels} is missing: PIQA needs the labels file beside {jsonl.name}")
    docs = read_jsonl(jsonl)
    gold = [int(x) for x in labels.read_text(encoding="utf-8").split()]
    if len(gold) != len(docs):
        raise DoelError(f"{jsonl} has {len(docs)} items but {labels} {len(gold)} labels")
    return _items(jsonl, list(zip(docs, gold)), lambda dg: piqa_item(*dg))


def foundry_item(doc: dict, delimiter: str) -> Item:
    """MosaicML ICL JSONL: multiple choice (query/choices/gold) or schema (context_options/
    continuation/gold: the contexts differ and the continuation is shared, which is lm-eval's
    partial scoring of WinoGrande; acc_norm then equals acc, as all lengths are the same)."""
    if "context_options" in doc:
        cont = " " + doc["continuation"].strip()
        n = len(doc["context_options"])
        requests = tuple((c, cont) for c in doc["context_options"])
        return Item(requests, int(doc["gold"]), (len(cont) - 1,) * n)
    return Item.choices(doc["query"] + delimiter, doc["choices"], int(doc["gold"]))


def _item_rng(key: str, seed: int) -> random.Random:
    # crc32, not hash(): Python salts str hashes per process, and distractors must not move.
    return random.Random(zlib.crc32(key.encode("utf-8")) + seed)


def passage_spans(passage: str, n_words: int) -> list[str]:
    """Distinct spans of n_words words of the passage, edge punctuation stripped."""
    words = passage.split()
    spans = (" ".join(words[i : i + n_words]).strip(SPAN_EDGES) for i in range(len(words)))
    return list(dict.fromkeys(s for s in spans if s))


def load_tydiqa(path: Path, seed: int = 0) -> list[Item]:
    """TyDi QA GoldP (SQuAD-style JSON): passage, question, the first answer against three
    spans of the same passage that share no text with any answer. Questions with too short a
    passage for three such spans are dropped (none in the Bengali dev set)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    items = []
    for article in data["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                answers = [a["text"].strip() for a in qa["answers"]]
                gold = answers[0]
                spans = [
                    s
                    for s in passage_spans(para["context"], len(gold.split()))
                    if not any(s in a or a in s for a in answers)
                ]
                if len(spans) < BN_DISTRACTORS:
                    continue
                rng = _item_rng(qa["id"], seed)
                choices = [gold, *rng.sample(spans, BN_DISTRACTORS)]
                rng.shuffle(choices)
                context = f"{para['context'].strip()}\n\n{BN_QUESTION} {qa['question'].strip()}"
                items.append(Item.choices(f"{context}\n{BN_ANSWER}", choices, choices.index(gold)))
    return items


def load_blanck(path: Path, seed: int = 0) -> list[Item]:
    """BLanCK CSV (term, question, context, category, ...): the question alone (the context
    states the answer) against the terms of three other rows of the same category."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"term", "question", "category"} <= set(rows[0]):
        raise DoelError(f"{path}: expected a BLanCK CSV with term, question, category columns")
    by_category: dict[str, list[str]] = {}
    for r in rows:
        by_category.setdefault(r["category"], []).append(r["term"].strip())
    items = []
    for n, r in enumerate(rows):
        gold = r["term"].strip()
        pool = sorted({t for t in by_category[r["category"]] if t and t != gold})
        if len(pool) < BN_DISTRACTORS:
            pool = sorted({t for ts in by_category.values() for t in ts if t and t != gold})
        rng = _item_rng(f"{n}:{gold}", seed)
        choices = [gold, *rng.sample(pool, BN_DISTRACTORS)]
        rng.shuffle(choices)
        query = f"{BN_QUESTION} {r['question'].strip()}\n{BN_ANSWER}"
        items.append(Item.choices(query, choices, choices.index(gold)))
    return items


def read_parquet(path: Path) -> list[dict]:
    """The rows of a Parquet file (a hub dataset's own file, or a stand-in for one)."""
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 (arrow's errors for damaged files are of many kinds)
        raise DoelError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


# The TituLLM sets by their columns: (columns that tell it, reader).
TITULM_FORMATS = (
    ({"passage", "question", "answer"}, boolq_bn_item),
    ({"question", "options", "answer"}, mmlu_bn_item),
    ({"question", "choices", "answer"}, mmlu_bn_item),
    ({"question_stem", "choices", "answerKey"}, stem_choices_item),
    ({"goal", "sol1", "sol2", "label"}, lambda d: piqa_item(d, int(d["label"]))),
)


def _load_rows_task(name: str, path: Path) -> list[Item]:
    docs = read_parquet(path) if path.suffix == ".parquet" else read_jsonl(path)
    if not docs:
        raise DoelError(f"{path} holds no items")
    keys = set(docs[0])
    if {"ctx", "endings"} <= keys or {"ctx_a", "endings"} <= keys:
        return _items(path, docs, hellaswag_item)
    for columns, make in TITULM_FORMATS:
        if columns <= keys:
            return _items(path, docs, make)
    if {"goal", "sol1", "sol2"} <= keys:
        return load_piqa(path)
    if {"query", "choices", "gold"} <= keys or {"context_options", "continuation"} <= keys:
        delimiter = FOUNDRY_DELIMITERS.get(name, "")
        return _items(path, docs, lambda d: foundry_item(d, delimiter))
    raise DoelError(
        f"{path}: unknown task format (keys {sorted(keys)}); expected HellaSwag (ctx, endings, "
        "label), PIQA (goal, sol1, sol2[, label]), query/choices/gold or context_options/"
        "continuation, or a TituLLM set (question/options|choices/answer, passage/question/"
        "answer, question_stem/choices/answerKey)"
    )


def load_task(name: str, path: str | Path, limit: int | None = None, seed: int = 0) -> list[Item]:
    """The items of a task file or folder, its format told by its contents; the first `limit`
    items when given. `name` picks llm-foundry's delimiter for its files (arc_easy, boolq...)."""
    path = Path(path)
    if not path.exists():
        raise DoelError(f"{name}: no such file or folder {path}")
    if path.is_dir():
        if not (path / "valid.jsonl").is_file():
            raise DoelError(f"{name}: folder {path} has no valid.jsonl (the PIQA layout)")
        items = load_piqa(path)
    elif path.suffix == ".csv":
        items = load_blanck(path, seed)
    elif path.suffix == ".json":
        items = load_tydiqa(path, seed)
    else:
        items = _load_rows_task(name, path)
    return items[:limit] if limit is not None else items


def parse_task_specs(specs: list[str]) -> dict[str, str]:
    """NAME=PATH arguments as {name: path}."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise DoelError(f"--tasks {spec!r}: expected NAME=PATH, e.g. hellaswag=val.jsonl")
        out[name] = path
    return out
