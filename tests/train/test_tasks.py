"""train/evals/tasks.py and train/evals/scoring.py: every task format from files written here,
the prompts and splits lm-eval uses, scores against brute force, the metrics, the CLI, and the
cross-check with lm-evaluation-harness item by item on a tiny HF-layout checkpoint."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from doel.train.common import DoelError
from doel.train.evals import scoring, tasks
from doel.train.evals.tasks import Item
from doel.train.model import Llama, ModelConfig

WORDS = (
    "the river rose in the night and the boats were pulled up onto the bank while the "
    "children watched from the school roof and their teacher counted them twice"
).split()


def tiny(vocab: int, scale: float = 1.0, max_pos: int = 64) -> Llama:
    """A 2-layer model with spread weights, so its predictions depend on the context (at the
    0.02 init every distribution is near uniform and would hide mistakes)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
    )
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, scale / math.sqrt(p.shape[1]))
    return model


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def hellaswag_rows(n: int, seed: int = 0) -> list[dict]:
    """HellaSwag-format rows with the WikiHow markers lm-eval's preprocessing removes."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = sentence(rng, 6) + ".", sentence(rng, 2)
        if i % 3 == 0:
            a = "[header] How to " + a + " [title] " + sentence(rng, 3) + " [step]  " + a
        rows.append(
            {
                "ind": i,
                "activity_label": sentence(rng, 2).title(),
                "ctx_a": a,
                "ctx_b": b,
                "ctx": a + " " + b,
                "endings": [sentence(rng, rng.randint(2, 9)) + "." for _ in range(4)],
                "label": rng.randrange(4),
            }
        )
    return rows


def write_piqa(folder, n: int, seed: int = 0):
    rng = random.Random(seed)
    folder.mkdir()
    rows = [
        {"goal": sentence(rng, 5) + "?", "sol1": sentence(rng, 7), "sol2": sentence(rng, 4)}
        for _ in range(n)
    ]
    write_jsonl(folder / "valid.jsonl", rows)
    (folder / "valid-labels.lst").write_text("".join(f"{rng.randrange(2)}\n" for _ in rows))
    return folder


def test_hellaswag_prompt_is_lm_evals():
    row = hellaswag_rows(1)[0]
    item = tasks.hellaswag_item(row)
    ctx = item.requests[0][0]
    assert ctx.startswith(row["activity_label"] + ": ")
    assert "[" not in ctx
    assert ctx.endswith(" " + row["ctx_b"].capitalize())
    assert [c for _, c in item.requests] == [" " + e for e in row["endings"]]
    assert item.lengths == tuple(len(e) for e in row["endings"]) and item.gold == row["label"]
    # A file with only ctx (the text reconstruction) uses it as it is.
    bare = tasks.hellaswag_item({k: row[k] for k in ("activity_label", "ctx", "endings", "label")})
    assert bare.requests[0][0] == tasks.hellaswag_clean(row["activity_label"] + ": " + row["ctx"])


def test_hellaswag_cleaning():
    assert tasks.hellaswag_clean(" a [title] b [step] c ") == "a. b c"
    lm_eval_utils = pytest.importorskip("lm_eval.tasks.hellaswag.utils")
    for row in hellaswag_rows(12):
        for text in (row["ctx_a"], *row["endings"]):
            assert tasks.hellaswag_clean(text) == lm_eval_utils.preprocess(text)


def test_every_format_loads(tmp_path):
    hs = write_jsonl(tmp_path / "hs.jsonl", hellaswag_rows(7))
    piqa = write_piqa(tmp_path / "piqa", 5)
    mc = [
        {"query": f"Question: q{i}?", "choices": ["a", "bb", "ccc"], "gold": i % 3}
        for i in range(4)
    ]
    schema = [
        {
            "context_options": ["Ann took it so Ann", "Ann took it so Bo"],
            "continuation": "ran.",
            "gold": 1,
        }
    ]
    write_jsonl(tmp_path / "arc_easy.jsonl", mc)
    write_jsonl(tmp_path / "wg.jsonl", schema)
    assert len(tasks.load_task("hellaswag", hs)) == 7
    assert len(tasks.load_task("hellaswag", hs, limit=3)) == 3
    p = tasks.load_task("piqa", piqa)
    assert len(p) == 5 and p[0].requests[0][0].startswith("Question: ") and len(p[0].requests) == 2
    assert tasks.load_task("piqa", piqa / "valid.jsonl") == p
    arc = tasks.load_task("arc_easy", tmp_path / "arc_easy.jsonl")
    copa = tasks.load_task("copa", tmp_path / "arc_easy.jsonl")  # same file, copa's delimiter
    assert arc[1].requests[2] == ("Question: q1?\nAnswer:", " ccc") and arc[1].gold == 1
    assert copa[1].requests[2] == ("Question: q1?", " ccc")
    (wg,) = tasks.load_task("winogrande", tmp_path / "wg.jsonl")
    assert wg.requests == (("Ann took it so Ann", " ran."), ("Ann took it so Bo", " ran."))
    assert wg.gold == 1 and wg.lengths[0] == wg.lengths[1]


def test_bad_inputs_say_what_to_do(tmp_path):
    piqa = write_piqa(tmp_path / "piqa", 4)
    (piqa / "valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(DoelError, match="4 items but .* 2 labels"):
        tasks.load_task("piqa", piqa)
    write_jsonl(tmp_path / "odd.jsonl", [{"question": "x"}])
    with pytest.raises(DoelError, match="unknown task format"):
        tasks.load_task("odd", tmp_path / "odd.jsonl")
    write_jsonl(
        tmp_path / "bad.jsonl",
        [{"query": "q", "choices": ["a", "b"], "gold": 0}] * 2
        + [{"query": "q", "choices": ["a", "b"], "gold": 2}],
    )
    with pytest.raises(DoelError, match="bad.jsonl: item 3: gold 2 is not an index"):
        tasks.load_task("copa", tmp_path / "bad.jsonl")
    write_jsonl(tmp_path / "hs.jsonl", [{"ctx": "c", "endings": ["a"], "activity_label": "x"}])
    with pytest.raises(DoelError, match="item 1: missing field 'label'"):
        tasks.load_task("hellaswag", tmp_path / "hs.jsonl")
    with pytest.raises(DoelError, match="no such file"):
        tasks.load_task("x", tmp_path / "missing.jsonl")
    with pytest.raises(DoelError, match="NAME=PATH"):
        tasks.parse_task_specs(["hellaswag"])


def write_tydiqa(path, n: int):
    rng = random.Random(1)
    qas, paragraphs = [], []
    for i in range(n):
        passage = sentence(rng, 30) + " ঢাকা বাংলাদেশের রাজধানী। " + sentence(rng, 20)
        qa = {"id": f"q{i}", "question": "রাজধানী কোথায়?", "answers": [{"text": "ঢাকা"}]}
        paragraphs.append({"context": passage, "qas": [qa]})
        qas.append(qa)
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


def test_tydiqa_distractors_are_same_length_spans_of_the_passage(tmp_path):
    path = write_tydiqa(tmp_path / "tydi.json", 6)
    items = tasks.load_task("bn_tydiqa", path)
    assert items == tasks.load_task("bn_tydiqa", path)  # the same distractors every time
    passage = json.loads(path.read_text())["data"][0]["paragraphs"][0]["context"]
    first = items[0]
    choices = [c.strip() for _, c in first.requests]
    assert len(choices) == 4 and choices[first.gold] == "ঢাকা"
    for k, c in enumerate(choices):
        if k != first.gold:
            assert c in passage.split() and "ঢাকা" not in c
    assert first.requests[0][0].startswith(passage) and first.requests[0][0].endswith("উত্তর:")
    assert len({it.gold for it in items}) > 1  # the gold is not always in one place


def test_blanck_distractors_come_from_the_same_category(tmp_path):
    path = tmp_path / "BlanCK.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["term", "question", "context", "popularity", "category", "Culture_type"])
        for i in range(12):
            cat = "Food" if i % 2 else "People"
            w.writerow([f"{cat}{i}", f"প্রশ্ন {i}?", "ctx", "0.1", cat, "Cultural"])
    items = tasks.load_task("bn_blanck", path)
    assert len(items) == 12
    for n, it in enumerate(items):
        choices = [c.strip() for _, c in it.requests]
        assert choices[it.gold] == f"{'Food' if n % 2 else 'People'}{n}"
        assert len(set(choices)) == 4 and all(c[:4] == choices[it.gold][:4] for c in choices)
        assert "context" not in it.requests[0][0] and it.requests[0][0].endswith("উত্তর:")


@pytest.fixture(scope="module")
def model(tok):
    return tiny(tok.get_vocab_size())


def brute_force(model, tok, context: str, continuation: str) -> float:
    ctx = tok.encode(context).ids
    cont = tok.encode(context + continuation).ids[len(ctx) :]
    ids = (ctx + cont)[-(model.config.max_position_embeddings + 1) :]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0]
    return sum(float(logp[len(ids) - 1 - len(cont) + k, t]) for k, t in enumerate(cont))


def test_loglikelihoods_equal_brute_force_in_any_batching(model, tok, sample_paths):
    rng = random.Random(0)
    text = Path(sample_paths[1]).read_text(encoding="utf-8").split()
    bn = Path(sample_paths[0]).read_text(encoding="utf-8").split()
    requests = [(" ".join(text[:3]), " " + " ".join(bn[:4]))]  # mixed scripts
    requests += [
        (" ".join(rng.sample(text, rng.randint(1, 40))), " " + rng.choice(text)) for _ in range(9)
    ]
    requests += [(" ".join(text[:200]), " " + " ".join(text[200:205]))]  # cut from the left
    expected = [brute_force(model, tok, c, k) for c, k in requests]
    for kw in ({"batch_size": 1}, {"batch_size": 16}, {"batch_size": 5, "max_batch_tokens": 100}):
        got = scoring.loglikelihoods(model, tok, requests, **kw)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert model.training  # mode restored
    h, t = torch.randn(10, model.config.hidden_size), torch.arange(10)
    torch.testing.assert_close(
        scoring._target_logprobs(model, h, t, chunk=3), scoring._target_logprobs(model, h, t)
    )


def test_trailing_context_space_moves_to_the_continuation(model, tok):
    a = scoring.encode_requests(tok, [("The river", " rose"), ("The river ", "rose")])
    assert a[0] == a[1] and a[0][0][0] == tok.token_to_id("<|bos|>")
    (empty,) = scoring.encode_requests(tok, [("", "The river")])
    assert empty == (
        [tok.token_to_id("<|bos|>")],
        tok.encode("The river", add_special_tokens=False).ids,
    )


def test_metrics():
    items = [Item.choices("q", ["a", "bbbbbbbb"], gold=1) for _ in range(100)]
    # Choice 1 has the lower total but the higher log-likelihood per character.
    lls = [[-2.0, -8.0]] * 60 + [[-9.0, -1.0]] * 40
    r = scoring.summarize(items, lls)
    assert r["acc"] == pytest.approx(0.4) and r["acc_norm"] == pytest.approx(1.0)
    assert r["chance"] == pytest.approx(0.5) and r["items"] == 100
    assert r["acc_stderr"] == pytest.approx(math.sqrt(0.4 * 0.6 / 100), rel=0.1)
    assert r["acc_norm_stderr"] == 0.0
    pred, _ = scoring.predictions(items[:1], [[-1.0, -1.0]])
    assert pred == [0]  # ties: the first, as np.argmax
    assert "| x | 100 | 0.400 ± 0.0" in scoring.format_tasks({"x": r})
    # Always answering "the first choice" scores the share of gold 0, whatever chance says.
    uneven = [Item.choices("q", ["a", "b", "c"], gold=int(i % 4 == 0)) for i in range(100)]
    r = scoring.summarize(uneven, [[0.0, -1.0, -1.0]] * 100)
    assert r["acc"] == r["majority"] == pytest.approx(0.75)
    assert r["chance"] == pytest.approx(1 / 3)


def test_task_accuracy_follows_the_models_ranking(model, tok):
    """Choices that are single tokens after the context, ranked by the model's own next-token
    distribution: with the most likely one as gold accuracy is 1, with the least likely 0."""
    rng = random.Random(3)
    best, worst = [], []
    for _ in range(20):
        p = " ".join(rng.choice(WORDS) for _ in range(5))
        ctx = tok.encode(p).ids
        with torch.no_grad():
            order = model(torch.tensor([ctx]))[0, -1].argsort(descending=True).tolist()
        # Keep tokens that come back as themselves after the context (BPE may merge others).
        pieces = [tok.decode([t]) for t in order[:200]]
        pieces = [s for t, s in zip(order, pieces) if tok.encode(p + s).ids == [*ctx, t]][:3]
        if len(pieces) == 3:
            best.append(Item.choices(p, pieces, gold=0, delimiter=""))
            worst.append(Item.choices(p, pieces, gold=2, delimiter=""))
    assert len(best) >= 5
    assert scoring.task_accuracy(model, tok, best)["acc"] == 1.0
    assert scoring.task_accuracy(model, tok, worst)["acc"] == 0.0

    class Wrapped(torch.nn.Module):  # as DDP holds a model (fit may pass one)
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert scoring.task_accuracy(Wrapped(model), tok, worst) == scoring.task_accuracy(
        model, tok, worst
    )


def test_eval_cli_runs_tasks(tok, tokenizer_path, sample_paths, tmp_path, capsys):
    from doel.train.cli import main
    from doel.train.hf import save_model

    folder = save_model(tiny(tok.get_vocab_size()), tmp_path / "m", tokenizer_path)
    hs = write_jsonl(tmp_path / "hs.jsonl", hellaswag_rows(10))
    piqa = write_piqa(tmp_path / "piqa", 6)
    argv = ["eval", str(folder), "--text", sample_paths[1], "--max-chars", "500"]
    main([*argv, "--tasks", f"hellaswag={hs}", f"piqa={piqa}", "--limit", "4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["tasks"]["hellaswag"]["items"] == 4 and r["tasks"]["piqa"]["chance"] == 0.5
    from doel.train.evals.heldout import format_eval

    assert "| piqa | 4 | " in format_eval(r) and "acc_norm" in format_eval(r)


@pytest.mark.slow
def test_item_by_item_equal_to_lm_eval(tok, tokenizer_path, tmp_path):
    """lm-eval (its own hellaswag/piqa task definitions, transformers' Llama and tokenizer) and
    our scorer give the same choice log-likelihoods and the same verdicts, item by item."""
    pytest.importorskip("lm_eval")
    from doel.train.data.tokenizer import load_tokenizer
    from doel.train.evals.crosscheck import lm_eval_choices
    from doel.train.hf import load_model, save_model

    net = tiny(tok.get_vocab_size(), scale=2.0)
    folder = save_model(net, tmp_path / "ckpt", tokenizer_path)
    files = {
        "hellaswag": write_jsonl(tmp_path / "hs.jsonl", hellaswag_rows(30)),
        "piqa": write_piqa(tmp_path / "piqa", 30),
    }
    ours_model, ours_tok = load_model(folder), load_tokenizer(folder)
    for name, path in files.items():
        items = tasks.load_task(name, path)
        lls = scoring.score_items(ours_model, ours_tok, items, batch_size=7)
        theirs = lm_eval_choices(folder, name, path, batch_size=4)
        assert len(theirs) == len(items) == 30
        pred, norm = scoring.predictions(items, lls)
        for it, ll, p, q, th in zip(items, lls, pred, norm, theirs):
            np.testing.assert_allclose(ll, th["lls"], rtol=1e-5, atol=1e-3)
            assert p == int(np.argmax(th["lls"]))
            assert (p == it.gold) == bool(th["acc"]) and (q == it.gold) == bool(th["acc_norm"])


def test_one_item_longer_than_the_context_is_cut_from_the_left_and_counted(model, tok):
    """Issue 38: one item whose continuation outgrew the model's context stopped the whole
    task. It is scored on the last tokens that fit (the window lm-eval takes) and counted."""
    limit = model.config.max_position_embeddings
    rng = random.Random(3)
    long_cont = " " + sentence(rng, 4 * limit)  # far more tokens than the context
    long_ctx = sentence(rng, 3 * limit)  # a context alone longer than the window
    items = [
        Item.choices("A short question?", [" yes", " no"], 0),
        Item.choices("Another one?", [long_cont, " no"], 1),
        Item.choices(long_ctx, [" yes", " no"], 0),
    ]
    r = scoring.task_accuracy(model, tok, items)
    assert r["items"] == 3 and r["truncated"] == 2
    ctx_ids = tok.encode("Another one?").ids
    cont_ids = tok.encode("Another one?" + long_cont).ids[len(ctx_ids) :]
    assert len(cont_ids) > limit
    (ll,) = scoring.loglikelihoods(model, tok, [("Another one?", long_cont)])
    window = (ctx_ids + cont_ids)[-(limit + 1) :]  # all continuation: its last `limit` scored
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([window[:-1]])).float(), -1)[0]
    assert ll == pytest.approx(sum(float(logp[k, t]) for k, t in enumerate(window[1:])), abs=1e-3)
    text = scoring.format_tasks({"piqa": r})
    assert "piqa: 2 of 3 items were longer than the model's context" in text
    assert "cut from the left" not in scoring.format_tasks({"piqa": r | {"truncated": 0}})


@pytest.mark.slow
def test_items_longer_than_the_context_equal_lm_evals(tok, tokenizer_path, tmp_path):
    """Cut from the left, item by item as lm-eval cuts them: the same log-likelihoods within
    the cross-check's bound (test_item_by_item_equal_to_lm_eval) on items whose context and
    continuation together outgrow the model's 64 positions."""
    pytest.importorskip("lm_eval")
    from doel.train.data.tokenizer import load_tokenizer
    from doel.train.evals.crosscheck import lm_eval_choices
    from doel.train.hf import load_model, save_model

    folder = save_model(tiny(tok.get_vocab_size(), scale=2.0), tmp_path / "ckpt", tokenizer_path)
    rng = random.Random(5)
    rows = [
        {"goal": sentence(rng, 80) + "?", "sol1": sentence(rng, 12), "sol2": sentence(rng, 6)}
        for _ in range(6)
    ]
    piqa = tmp_path / "piqa"
    piqa.mkdir()
    write_jsonl(piqa / "valid.jsonl", rows)
    (piqa / "valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(6)))
    items = tasks.load_task("piqa", piqa)
    cut: list[int] = []
    lls = scoring.score_items(load_model(folder), load_tokenizer(folder), items, cut=cut)
    assert cut == list(range(6))  # every item was cut
    theirs = lm_eval_choices(folder, "piqa", piqa, batch_size=4)
    for ll, th in zip(lls, theirs, strict=True):
        np.testing.assert_allclose(ll, th["lls"], rtol=1e-5, atol=1e-3)
