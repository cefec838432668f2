"""`doel-train eval` and the model card (issue 38, points 3 and 5): an empty text is an error,
the card names the texts (and their hashes) behind each figure and keeps earlier rows for other
texts, --no-card leaves it alone, and a model no better than its random twin is said to be."""

from __future__ import annotations

import hashlib
import json

import pytest

from doel.train.cli import main
from doel.train.common import DoelError
from doel.train.evals.heldout import evaluate_checkpoint, format_eval
from doel.train.evals.modelcard import CARD_INPUTS, write_model_card


@pytest.fixture
def carded(model_folder):
    """A model folder with doel's card, not yet evaluated."""
    folder = model_folder(seed=1)
    write_model_card(folder)
    return folder


def _eval(folder, *texts, **kw):
    return evaluate_checkpoint(folder, list(map(str, texts)), max_chars=400, prompts=[], **kw)


def test_an_empty_text_is_an_error_and_the_card_is_untouched(carded, tmp_path, sample_paths):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n", encoding="utf-8")
    before = (carded / "README.md").read_text(encoding="utf-8")
    with pytest.raises(DoelError, match="empty.txt: no text to evaluate"):
        _eval(carded, empty)
    with pytest.raises(DoelError, match="empty.txt"):  # beside a good text too
        _eval(carded, sample_paths[0], empty)
    assert (carded / "README.md").read_text(encoding="utf-8") == before
    with pytest.raises(SystemExit, match="no text to evaluate"):
        main(["eval", str(carded), "--text", str(empty), "--quiet"])


def test_the_card_names_each_figures_texts_and_keeps_other_texts_rows(
    carded, tmp_path, sample_paths
):
    bn, en = sample_paths
    _eval(carded, bn, en)
    outside = tmp_path / "outside-bn.txt"
    outside.write_text("বাংলা ভাষা একটি সুন্দর ভাষা। " * 20, encoding="utf-8")
    result = _eval(carded, outside)
    text = (carded / "README.md").read_text(encoding="utf-8")
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    rows = [line for line in text.splitlines() if line.startswith("| bn |")]
    assert len(rows) == 2  # the held-out bn row stayed beside the outside text's
    assert any(f"`outside-bn.txt` (sha256 {digest[:12]})" in r for r in rows)
    assert any("`bn.txt`" in r for r in rows)
    assert any(line.startswith("| en |") and "`en.txt`" in line for line in text.splitlines())
    saved = json.loads((carded / CARD_INPUTS).read_text(encoding="utf-8"))["eval_result"]
    assert {t["sha256"] for r in saved["languages"].values() for t in r["texts"]} >= {digest}
    bpc = result["languages"]["bn"]["model"]["bits_per_char"]
    assert any(f"{bpc:.3f}" in r and "outside-bn.txt" in r for r in rows)
    # the same texts again replace their own row, not add one
    _eval(carded, outside)
    text = (carded / "README.md").read_text(encoding="utf-8")
    assert len([line for line in text.splitlines() if line.startswith("| bn |")]) == 2


def test_no_card_leaves_the_card_alone(carded, sample_paths, capsys):
    before = (carded / "README.md").read_bytes(), (carded / CARD_INPUTS).read_bytes()
    main(["eval", str(carded), "--text", sample_paths[1], "--max-chars", "300", "--no-card"])
    after = (carded / "README.md").read_bytes(), (carded / CARD_INPUTS).read_bytes()
    assert after == before
    assert "model card updated" not in capsys.readouterr().out


def _result(model_bpc: float, twin_bpc: float) -> dict:
    figures = {"nats_per_token": 4.0, "chars": 10, "documents": 1}
    return {
        "checkpoint": "ckpt",
        "parameters": 10,
        "vocab_size": 2048,
        "seq_len": 64,
        "languages": {
            "bn": {
                "texts": [{"name": "outside.txt", "sha256": "0" * 64}],
                "model": figures | {"bits_per_char": model_bpc},
                "twin": figures | {"bits_per_char": twin_bpc},
                "compressors": {"xz -9e": 3.0, "bzip2 -9": 3.1},
            }
        },
    }


def test_a_model_no_better_than_its_random_twin_is_flagged_in_one_line():
    worse = format_eval(_result(6.000, 5.987))
    (line,) = [x for x in worse.splitlines() if "random twin" in x and "WARNING" in x]
    assert "bn (outside.txt)" in line and "6.000" in line and "5.987" in line
    assert "WARNING" not in format_eval(_result(2.5, 5.987))
