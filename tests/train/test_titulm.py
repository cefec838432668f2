"""The TituLLM suite's Bangla sets (Bangla MMLU, BoolQ-BN, CommonsenseQA-BN, OpenBookQA-BN,
PIQA-BN): readers for their hub columns on small made-up files in exactly that schema, the
suite's prompts, the same scoring as every task (chance, majority, standard error), and the
`hf:` path fetched once from a local stand-in or the `datasets` stream."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from doel.train.common import DoelError
from doel.train.evals import scoring, tasks
from doel.train.evals.hubtasks import HubTask, fetch_task, fetch_tasks
from doel.train.model import Llama, ModelConfig

# Made-up items in the columns of each hub dataset (hishab-nlp's lm-eval task yamls).
MMLU = [  # hishab/bangla-mmlu: question, choices, answer (ClassLabel index)
    {"question": "বাংলাদেশের রাজধানী কোনটি? ", "choices": ["খুলনা", "ঢাকা", "সিলেট", "রাজশাহী"], "answer": 1},
    {"question": "এক সপ্তাহে কত দিন?", "choices": ["পাঁচ", "ছয়", "সাত", "আট"], "answer": 2},
    {"question": "পানির সংকেত কী?", "choices": ["H2O", "CO2", "O2", "NaCl"], "answer": 0},
    {"question": "সূর্য কোন দিকে ওঠে?", "choices": ["পশ্চিম", "উত্তর", "দক্ষিণ", "পূর্ব"], "answer": 3},
]  # fmt: skip
TITULM_MMLU = [  # hishab/titulm-bangla-mmlu: question, options, answer (the letter)
    {"question": "দুই আর দুই যোগ করলে কত?", "options": ["তিন", "চার", "পাঁচ", "ছয়"], "answer": "B"},
    {"question": "রবীন্দ্রনাথ কী পান?", "options": ["নোবেল", "অস্কার", "বুকার", "পুলিৎজার"], "answer": "A"},
]  # fmt: skip
BOOLQ = [  # hishab/boolq_bn: passage, question, answer (bool)
    {"passage": "পদ্মা বাংলাদেশের একটি বড় নদী।", "question": "পদ্মা কি একটি নদী", "answer": True},
    {"passage": "বিড়াল একটি গৃহপালিত প্রাণী।", "question": "বিড়াল কি উড়তে পারে", "answer": False},
    {"passage": "শীতকালে দিন ছোট হয়।", "question": "শীতকালে কি দিন ছোট হয়", "answer": True},
]
# hishab/commonsenseqa-bn and openbookqa-bn: question_stem, choices {label, text}, answerKey
STEM = [
    {
        "question_stem": "বৃষ্টির সময় মানুষ মাথার ওপর কী ধরে?",
        "choices": {"label": ["A", "B", "C", "D", "E"], "text": ["ছাতা", "থালা", "বই", "কলম", "জুতা"]},
        "answerKey": "A",
    },
    {
        "question_stem": "রান্না করতে কী লাগে?",
        "choices": {"label": ["A", "B", "C", "D", "E"], "text": ["বরফ", "আগুন", "কাগজ", "বালি", "সুতা"]},
        "answerKey": " B",
    },
]  # fmt: skip
PIQA = [  # hishab/piqa-bn: goal, sol1, sol2, label
    {"goal": "চা গরম রাখতে চাই", "sol1": "ফ্লাস্কে রাখো", "sol2": "ফ্রিজে রাখো", "label": 0},
    {"goal": "কাপড় শুকাতে চাই", "sol1": "পানিতে ভেজাও", "sol2": "রোদে মেলে দাও", "label": 1},
    {"goal": "অন্ধকারে দেখতে চাই", "sol1": "বাতি জ্বালাও", "sol2": "চোখ বন্ধ করো", "label": 0},
]


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_each_set_reads_with_the_suites_prompt(tmp_path, suffix):
    def load(name, rows):
        return tasks.load_task(name, write_rows(tmp_path / f"{name}{suffix}", rows))

    mmlu = load("bangla_mmlu", MMLU)
    assert mmlu[0].requests[1] == (
        "বাংলাদেশের রাজধানী কোনটি?\nA. খুলনা\nB. ঢাকা\nC. সিলেট\nD. রাজশাহী\nAnswer:",
        " B",
    )
    assert [it.gold for it in mmlu] == [1, 2, 0, 3]
    assert [c for _, c in mmlu[0].requests] == [" A", " B", " C", " D"]
    titulm = load("titulm_mmlu", TITULM_MMLU)
    assert [it.gold for it in titulm] == [1, 0]
    assert titulm[1].requests[0][0].splitlines()[1] == "A. নোবেল"
    boolq = load("boolq_bn", BOOLQ)
    assert boolq[0].requests == (
        ("পদ্মা বাংলাদেশের একটি বড় নদী।\nQuestion: পদ্মা কি একটি নদী?\nAnswer:", " no"),
        ("পদ্মা বাংলাদেশের একটি বড় নদী।\nQuestion: পদ্মা কি একটি নদী?\nAnswer:", " yes"),
    )
    assert [it.gold for it in boolq] == [1, 0, 1]
    stem = load("commonsenseqa_bn", STEM)
    assert stem[0].requests[0] == ("বৃষ্টির সময় মানুষ মাথার ওপর কী ধরে?", " ছাতা")
    assert [it.gold for it in stem] == [0, 1] and len(stem[0].requests) == 5
    assert stem[0].lengths == (4, 4, 2, 3, 4)  # acc_norm divides by the choice's characters
    piqa = load("piqa_bn", PIQA)
    assert piqa[1].requests[1] == ("Question: কাপড় শুকাতে চাই\nAnswer:", " রোদে মেলে দাও")
    assert [it.gold for it in piqa] == [0, 1, 0]


def test_a_malformed_item_is_named(tmp_path):
    bad = [MMLU[0], {**MMLU[1], "choices": ["এক", "দুই"]}]
    with pytest.raises(DoelError, match=r"item 2: expected 4 options"):
        tasks.load_task("bangla_mmlu", write_rows(tmp_path / "m.jsonl", bad))
    bad = [{**BOOLQ[0], "answer": "হ্যাঁ"}]
    with pytest.raises(DoelError, match="item 1: answer must be true or false"):
        tasks.load_task("boolq_bn", write_rows(tmp_path / "b.jsonl", bad))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DoelError, match="not a readable Parquet file"):
        tasks.load_task("piqa_bn", tmp_path / "broken.parquet")


def tiny(vocab: int) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    return Llama(cfg)


def test_scored_like_every_task_with_chance_majority_and_stderr(tmp_path, tok):
    model = tiny(tok.get_vocab_size())
    sets = {"bangla_mmlu": MMLU, "boolq_bn": BOOLQ, "commonsenseqa_bn": STEM, "piqa_bn": PIQA}
    paths = {n: str(write_rows(tmp_path / f"{n}.jsonl", rows)) for n, rows in sets.items()}
    results = scoring.run_tasks(model, tok, paths, progress=False)
    chance = {"bangla_mmlu": 0.25, "boolq_bn": 0.5, "commonsenseqa_bn": 0.2, "piqa_bn": 0.5}
    majority = {"bangla_mmlu": 0.25, "boolq_bn": 2 / 3, "commonsenseqa_bn": 0.5, "piqa_bn": 2 / 3}
    for name, r in results.items():
        items = tasks.load_task(name, paths[name])
        lls = scoring.score_items(model, tok, items)
        pred, _ = scoring.predictions(items, lls)
        assert r["acc"] == sum(p == it.gold for p, it in zip(pred, items)) / len(items)
        assert r["chance"] == pytest.approx(chance[name])
        assert r["majority"] == pytest.approx(majority[name])
        assert r["items"] == len(sets[name]) and math.isfinite(r["acc_stderr"])
    assert "| boolq_bn | 3 | " in scoring.format_tasks(results)


def test_a_spec_takes_the_suites_config_and_split():
    assert HubTask.parse("hf:hishab/piqa-bn") == HubTask("hishab/piqa-bn", "", "validation")
    assert HubTask.parse("hf:hishab/openbookqa-bn").split == "test"
    assert HubTask.parse("hf:hishab/boolq_bn@train") == HubTask("hishab/boolq_bn", "", "train")
    t = HubTask.parse("hf:hishab/titulm-bangla-mmlu:Job_Exams-IQ")
    assert (t.config, t.split) == ("Job_Exams-IQ", "test")
    assert t.slug == "hishab__titulm-bangla-mmlu--Job_Exams-IQ--test"
    with pytest.raises(DoelError, match="hf:OWNER/DATASET"):
        HubTask.parse("hf:piqa-bn")


def test_a_fetch_is_written_once_and_redone_only_for_another_set(tmp_path):
    standin = write_rows(tmp_path / "piqa.parquet", PIQA)
    task = HubTask.parse("hf:hishab/piqa-bn")
    out = fetch_task(task, tmp_path / "cache", str(standin))
    assert [json.loads(x) for x in out.read_text("utf-8").splitlines()] == PIQA
    stamp = out.stat().st_mtime_ns
    assert fetch_task(task, tmp_path / "cache", str(standin)) == out
    assert out.stat().st_mtime_ns == stamp  # complete: not fetched again
    other = write_rows(tmp_path / "piqa2.jsonl", PIQA[:2])
    fetch_task(task, tmp_path / "cache", str(other))  # another stand-in: fetched again
    assert len(out.read_text("utf-8").splitlines()) == 2
    assert not list((tmp_path / "cache").glob(".*.tmp"))


def test_the_hub_stream_gets_the_suites_split_and_a_failure_leaves_the_set_out(
    tmp_path, monkeypatch
):
    datasets = pytest.importorskip("datasets")
    asked = []

    def load_dataset(name, config=None, split=None, streaming=False):
        asked.append((name, config, split, streaming))
        if name == "hishab/boolq_bn":
            raise ConnectionError("no route to the hub")
        return iter(STEM)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    logs: list[str] = []
    spec = {
        "commonsenseqa_bn": "hf:hishab/commonsenseqa-bn",
        "boolq_bn": "hf:hishab/boolq_bn",
        "arc_easy": "arc.jsonl",  # a plain file is passed through as it is
    }
    found, missing = fetch_tasks(spec, tmp_path, log=logs.append)
    assert asked == [
        ("hishab/commonsenseqa-bn", None, "validation", True),
        ("hishab/boolq_bn", None, "validation", True),
    ]
    assert found["arc_easy"] == "arc.jsonl"
    assert len(tasks.load_task("commonsenseqa_bn", found["commonsenseqa_bn"])) == 2
    assert list(missing) == ["boolq_bn"] and "no route to the hub" in missing["boolq_bn"]
    assert "boolq_bn" in logs[0]
    # Offline (the recipe's dry run), a hub set without a stand-in is left out unasked.
    found, missing = fetch_tasks({"piqa_bn": "hf:hishab/piqa-bn"}, tmp_path, offline=True)
    assert found == {} and "--local piqa_bn=FILE" in missing["piqa_bn"]
    assert len(asked) == 2


@pytest.mark.slow  # a whole `doel-train eval` process (~12 s on 2 cores)
def test_eval_cli_scores_a_hub_set_from_a_stand_in(tok, tokenizer_path, sample_paths, tmp_path):
    import subprocess
    import sys

    from doel.train.hf import save_model

    folder = save_model(tiny(tok.get_vocab_size()), tmp_path / "m", tokenizer_path)
    standin = write_rows(tmp_path / "mmlu.parquet", MMLU)
    argv = [sys.executable, "-m", "doel.train", "eval", str(folder), "--text", sample_paths[1]]
    argv += ["--max-chars", "300", "--json", "--task-cache", str(tmp_path / "cache")]
    argv += ["--tasks", "bangla_mmlu=hf:hishab/bangla-mmlu", "boolq_bn=hf:nobody/none"]
    argv += ["--local", f"bangla_mmlu={standin}"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert set(r["tasks"]) == {"bangla_mmlu"}
    assert r["tasks"]["bangla_mmlu"]["items"] == 4 and r["tasks"]["bangla_mmlu"]["chance"] == 0.25
    assert r["tasks"]["bangla_mmlu"]["path"].endswith("hishab__bangla-mmlu--test.jsonl")
    assert "left out" in p.stderr and "boolq_bn" in p.stderr
    from doel.train.evals.heldout import format_eval

    text = format_eval(r)  # the printed report sets it beside the published baselines
    assert "| Bangla MMLU (`bangla_mmlu`) | 0.25 | 0.282 ± 0.004 | 0.308 ± 0.004 | " in text


def test_the_card_sets_doel_beside_the_published_baselines(tok, tokenizer_path, tmp_path):
    from doel.train.evals.modelcard import write_model_card
    from doel.train.evals.published import BASELINES, binomial_stderr
    from doel.train.hf import save_model

    # The stored counts give back the published fractions (the 0.282, 0.308, 0.53).
    mmlu, piqa = BASELINES["bangla_mmlu"][2], BASELINES["piqa_bn"][2]
    assert round(mmlu["Llama-3.2-1B"][0] / mmlu["Llama-3.2-1B"][1], 3) == 0.282
    assert round(mmlu["Qwen2.5-0.5B"][0] / mmlu["Qwen2.5-0.5B"][1], 3) == 0.308
    assert round(piqa["Llama-3.2-1B"][0] / piqa["Llama-3.2-1B"][1], 2) == 0.53
    assert binomial_stderr(50, 100) == pytest.approx(0.05)
    folder = save_model(tiny(tok.get_vocab_size()), tmp_path / "m", tokenizer_path)
    r = {"items": 1000, "acc": 0.55, "acc_stderr": 0.0157, "acc_norm": 0.54}
    r |= {"acc_norm_stderr": 0.0158, "chance": 0.5, "majority": 0.51}
    card = write_model_card(folder, eval_result={"languages": {}, "tasks": {"piqa_bn": r}})
    text = card.read_text("utf-8")
    assert (
        "| PIQA-BN (`piqa_bn`) | 0.50 | 0.529 ± 0.012 | 0.536 ± 0.012 | 0.550 ± 0.016 (1,000"
        in text
    )
    assert (
        "| Bangla MMLU (`bangla_mmlu`) | 0.25 | 0.282 ± 0.004 | 0.308 ± 0.004 | not scored |"
        in text
    )
    assert "arXiv:2502.11187" in text and 'name: "PIQA-BN (TituLLM suite)"' in text
