"""train/evals/modelcard.py: the README.md a model folder gets, its Hugging Face metadata
block, and that every figure in it is the one its source holds (parameters, fertility, data
mix, cost, eval)."""

from __future__ import annotations

import json

import pytest
import torch

from train.evals.modelcard import SAMPLE, stored_parameters, write_model_card
from train.hf import save_model
from train.model import Llama, ModelConfig


@pytest.fixture
def folder(tok, tokenizer_path, tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return save_model(Llama(cfg), tmp_path / "run" / "final", tokenizer=tokenizer_path)


def front_matter(text: str) -> dict:
    yaml = pytest.importorskip("yaml")
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


META = {
    "sources": {
        "bn_news": {"train_characters": 3000, "train_tokens": 700, "characters": 3300},
        "en_books": {"train_characters": 1000, "train_tokens": 250, "characters": 1100},
    }
}


def test_card_with_everything(folder, sample_paths, tmp_path):
    from train.data.fertility import fertility, load_any
    from train.data.textio import iter_documents
    from train.evals.heldout import evaluate_checkpoint

    piqa = tmp_path / "piqa"
    piqa.mkdir()
    rows = [{"goal": f"g{i}?", "sol1": "one way", "sol2": "the other"} for i in range(6)]
    (piqa / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (piqa / "valid-labels.lst").write_text("0\n1\n0\n1\n1\n0\n")
    result = evaluate_checkpoint(
        folder, sample_paths, max_chars=500, prompts=["The"], max_new_tokens=2,
        tasks={"piqa": str(piqa)},
    )  # fmt: skip
    state = {"step": 1234, "tokens_seen": 5_000_000, "config": {"seq_len": 64, "lr": 0.003}}
    path = write_model_card(
        folder, meta=META, train_state=state, eval_result=result,
        hardware="1x NVIDIA H100 80GB HBM3", seconds=7200, hourly_price=2.5,
    )  # fmt: skip
    text = path.read_text(encoding="utf-8")
    meta = front_matter(text)
    assert meta["language"] == ["bn", "en"] and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation" and meta["license"] == "apache-2.0"
    (entry,) = meta["model-index"]
    assert entry["name"] == "run"  # a run's final/ folder is named after the run
    (res,) = entry["results"]
    assert res["dataset"]["type"] == "piqa"
    assert res["metrics"][0]["value"] == pytest.approx(result["tasks"]["piqa"]["acc"], abs=1e-4)

    model = Llama(ModelConfig.from_hf(json.loads((folder / "config.json").read_text())))
    assert stored_parameters(folder) == model.num_parameters()
    assert f"| parameters (stored, tied once) | {model.num_parameters():,} |" in text
    texts = [d for p in sorted(SAMPLE.glob("*.txt")) for d in iter_documents(str(p))]
    report = fertility(load_any(folder / "tokenizer.json"), texts)
    for script, r in report.items():
        assert f"| {script} | {r['characters']:,} | {r['tokens']:,} |" in text
    assert "| bn_news | 3,000 | 75.0% | 700 | 73.7% | 4.29 |" in text
    assert "| **total** | 4,000 | 100% | 950 | 100% |" in text
    assert "| tokens seen | 5,000,000 |" in text and "| steps | 1,234 |" in text
    assert "| seq_len | 64 |" in text and "H100" in text
    assert "$5.00 (at $2.5/hour)" in text
    for lang in ("bn", "en"):
        bpc = result["languages"][lang]["model"]["bits_per_char"]
        assert f"| {lang} | {result['languages'][lang]['model']['chars']:,} | {bpc:.3f} |" in text
    assert "| piqa | 6 |" in text


def test_card_says_what_is_missing(folder):
    text = write_model_card(folder).read_text(encoding="utf-8")
    meta = front_matter(text)
    assert "model-index" not in meta and meta["tags"]
    assert "Not recorded (no shards meta.json" in text and "Not evaluated yet" in text
    assert "| hardware | not recorded |" in text and "estimated cost" not in text
    # train_config.json in the folder stands in for a missing train_state.
    (folder / "train_config.json").write_text(json.dumps({"seq_len": 48, "schedule": "wsd"}))
    text = write_model_card(folder, seconds=90).read_text(encoding="utf-8")
    assert "| seq_len | 48 |" in text and "| schedule | wsd |" in text and "1m30s" in text


def test_transformers_still_loads_the_folder(folder):
    transformers = pytest.importorskip("transformers")
    write_model_card(folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert model.num_parameters() == stored_parameters(folder)
