"""train/evals/modelcard.py: the README.md a model folder gets, its Hugging Face metadata
block, and that every figure in it is the one its source holds (parameters, fertility, data
mix, cost, eval)."""

from __future__ import annotations

import json
import re
import time

import pytest

from doel.train.common import DoelError
from doel.train.evals.modelcard import SAMPLE, stored_parameters, write_model_card
from doel.train.metrics import read_metrics
from doel.train.model import Llama, ModelConfig


@pytest.fixture
def folder(model_folder):
    return model_folder(seed=0)


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
    from doel.train.data.fertility import fertility, load_any
    from doel.train.data.textio import iter_documents
    from doel.train.evals.heldout import evaluate_checkpoint

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


class FakeClock:
    """train.loop's clock: every reading is one second after the one before, so each training
    step takes exactly one second whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    time = staticmethod(time.time)


def test_a_resumed_run_card_sums_every_attempt_and_eval_fills_it_in(
    tmp_path, shards, tiny_config, sample_paths, monkeypatch
):
    """The demo's path: fit, killed at step 6 (checkpoint at 4), fit again, then evaluate."""
    import doel.train.loop
    from doel.train.evals.heldout import evaluate_checkpoint, format_eval
    from doel.train.fit import fit

    monkeypatch.setattr(doel.train.loop, "time", FakeClock())
    cfg = tiny_config("steps=8", "checkpoint_every=4", "eval_every=0", "log_every=1")

    class Killed(Exception):
        pass

    def killer(line):  # dies logging step 6, before its metrics row: 5 s were recorded
        if line.startswith("step      6/"):
            raise Killed

    run = tmp_path / "run"
    with pytest.raises(Killed):  # the checks before step 1 are not what this test is about
        fit(cfg, shards, run, log=killer, skip_verify=True)
    final = fit(cfg, shards, run, log=lambda s: None, skip_verify=True)  # resumes: 4 s more
    text = (final / "README.md").read_text(encoding="utf-8")
    assert "| time | 0m09s over 2 attempts (resumed runs) |" in text
    assert "| steps | 8 |" in text and "Not evaluated yet" in text
    rows = read_metrics(run / "metrics.jsonl")
    assert [r for r in rows if r["kind"] == "resume"] == [
        {"kind": "resume", "step": 4, "attempt": 2, "seconds": 5.0}
    ]
    assert [r["seconds"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 6, 7, 8, 9]

    result = evaluate_checkpoint(final, sample_paths, max_chars=500, prompts=["The"])
    assert result["model_card"] == str(final / "README.md")
    assert "model card updated" in format_eval(result)
    text = (final / "README.md").read_text(encoding="utf-8")
    assert "Not evaluated yet" not in text
    for lang in ("bn", "en"):
        bpc = result["languages"][lang]["model"]["bits_per_char"]
        assert f"| {lang} | {result['languages'][lang]['model']['chars']:,} | {bpc:.3f} |" in text
    # Everything the run wrote is still there: only the evaluation changed.
    assert "| time | 0m09s over 2 attempts (resumed runs) |" in text and "| steps | 8 |" in text
    assert "| bengali |" in text and "| hardware | 1 × CPU |" in text


def test_eval_leaves_a_folder_without_a_doel_card_alone(folder, sample_paths):
    from doel.train.evals.heldout import evaluate_checkpoint

    result = evaluate_checkpoint(folder, sample_paths, max_chars=200, prompts=["The"])
    assert result["model_card"] is None and not (folder / "README.md").exists()


def test_cost_counts_every_device(folder):
    text = write_model_card(
        folder, seconds=7200, attempts=3, devices=2, hourly_price=2.5, hardware="2 × H100"
    ).read_text(encoding="utf-8")
    assert "| time | 2h00m over 3 attempts (resumed runs) |" in text
    assert "$10.00 (at $2.5/hour × 2 devices)" in text


def test_the_usage_example_loads_from_where_the_card_was_written(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the command that wrote the card ran
    text = write_model_card(folder).read_text(encoding="utf-8")
    code = text.split("```python\n")[1].split("```")[0]
    assert 'from_pretrained("run/final")' in code
    pytest.importorskip("transformers")
    scope = {}
    exec(code, scope)  # the card's own example, run where its reader stands
    assert scope["model"].num_parameters() == stored_parameters(folder)
    assert scope["tok"]("আমাদের গ্রাম")["input_ids"]


def test_no_nan_in_the_card(folder):
    meta = {
        "sources": {
            "train-bn": {"train_characters": 3000, "train_tokens": 700},
            "heldout-bn": {"train_characters": 0, "train_tokens": 0, "val_characters": 900},
        }
    }
    nan = float("nan")
    empty = {"chars": 0, "bits_per_char": nan}
    result = {
        "languages": {
            "bn": {
                "model": empty,
                "twin": {"bits_per_char": nan},
                "compressors": {"xz -9e": nan, "bzip2 -9": nan},
            }
        },
        "tasks": {
            "piqa": {"items": 1, "acc": 1.0, "acc_stderr": nan, "acc_norm": 0.0,
                     "acc_norm_stderr": nan, "chance": 0.5, "majority": 1.0},
            "copa": {"items": 0, "acc": nan, "acc_stderr": nan, "acc_norm": nan,
                     "acc_norm_stderr": nan, "chance": nan, "majority": nan},
        },
    }  # fmt: skip
    text = write_model_card(folder, meta=meta, eval_result=result).read_text(encoding="utf-8")
    assert not re.search(r"\bnan\b", text, re.IGNORECASE)
    assert "| train-bn |" in text and "| heldout-bn |" not in text
    assert "Validation only (not trained on): heldout-bn." in text
    assert "| bn | 0 | n/a | n/a | n/a | n/a |" in text
    assert "| piqa | 1 | 1.000 | 0.000 | 0.500 | 1.000 |" in text
    assert "| copa | 0 | n/a | n/a | n/a | n/a |" in text
    (entry,) = front_matter(text)["model-index"]
    assert [r["dataset"]["type"] for r in entry["results"]] == ["piqa"]


def _snippets(text: str) -> tuple[str, str]:
    """The card's Python usage example and its publishing commands."""
    return text.split("```python\n")[1].split("```")[0], text.split("```bash\n")[1].split("```")[0]


def test_the_usage_loads_from_the_hub_once_a_repo_id_is_known(folder, tmp_path, monkeypatch):
    from huggingface_hub import ModelCard

    monkeypatch.chdir(tmp_path)
    code, publish = _snippets(write_model_card(folder).read_text(encoding="utf-8"))
    assert 'AutoModelForCausalLM.from_pretrained("run/final")' in code
    assert "hf upload YOUR-NAME/run run/final\n" in publish  # a placeholder to fill in
    assert "--repo-id YOUR-NAME/run-int4-onnx" in publish
    assert "hf upload YOUR-NAME/run-int4-onnx bundle-int4\n" in publish
    assert json.loads((folder / "model_card.json").read_text())["repo_id"] is None

    text = write_model_card(folder, repo_id="ann/doel-bangla-0.4b").read_text(encoding="utf-8")
    code, publish = _snippets(text)
    assert 'AutoModelForCausalLM.from_pretrained("ann/doel-bangla-0.4b")' in code
    assert 'AutoTokenizer.from_pretrained("ann/doel-bangla-0.4b")' in code
    assert "run/final" not in code and "YOUR-NAME" not in text
    assert "hf upload ann/doel-bangla-0.4b run/final\n" in publish
    assert "--repo-id ann/doel-bangla-0.4b-int4-onnx" in publish
    assert ModelCard(text).data.to_dict()["library_name"] == "transformers"
    # Written again without one (the recipe's final card, eval's refresh): the id stays.
    text = write_model_card(folder, seconds=60.0).read_text(encoding="utf-8")
    assert 'from_pretrained("ann/doel-bangla-0.4b")' in text and "| time | 1m00s |" in text
    with pytest.raises(DoelError, match="not a Hugging Face repository id"):
        write_model_card(folder, repo_id="ann/doel/0.4b")


def test_a_training_checkpoint_uploads_without_its_resume_files(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (folder / "optimizer.safetensors").write_bytes(b"")
    (folder / "trainer_state.json").write_text("{}")
    _, publish = _snippets(write_model_card(folder).read_text(encoding="utf-8"))
    upload = publish.splitlines()[1]
    assert upload == (
        'hf upload YOUR-NAME/run run/final --exclude "optimizer.safetensors" "trainer_state.json"'
    )


def test_eval_records_the_repo_id_and_refuses_a_bad_one(folder, sample_paths, capsys):
    from doel.train.cli import main

    args = ["eval", str(folder), "--text", *sample_paths, "--max-chars", "200", "--quiet"]
    main([*args, "--repo-id", "ann/doel-x"])  # no doel card to record it in: said, not lost
    assert "--repo-id was not recorded" in capsys.readouterr().err
    assert not (folder / "README.md").exists()
    write_model_card(folder)
    with pytest.raises(SystemExit) as e:
        main([*args, "--repo-id", "ann/doel--x"])
    assert "not a Hugging Face repository id" in str(e.value) and "\n" not in str(e.value)
    main([*args, "--repo-id", "ann/doel-x"])
    assert 'from_pretrained("ann/doel-x")' in (folder / "README.md").read_text(encoding="utf-8")
    assert "note:" not in capsys.readouterr().err
