"""The rented-GPU recipe (`doel recipe`): the shipped file and its budget, bad recipes named
by field, the disk and memory estimate and its refusal, the projection and the confirmation, a
download that resumes where it stopped (local files and the `datasets` streaming path), a
tokenization that resumes to the same shards, the whole dry run from .txt/.jsonl/.parquet
stand-ins with a rerun that skips every stage, the torchrun command, and the GPU slice refusing
without CUDA."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from doel.pipeline.budget import (
    MUON_TOKEN_RATIO,
    check_stage,
    confirm,
    estimate_needs,
    format_projection,
    hidden_matrix_count,
    overheads,
    parameter_count,
    projection,
)
from doel.pipeline.cli import main
from doel.pipeline.fetch import fetch_source
from doel.pipeline.runner import DEPENDS, RecipeRun, run_recipe
from doel.pipeline.spec import DataSpec, HubSource, load_recipe, make_plan
from doel.pipeline.stages import torchrun_command
from doel.train.cli import build_parser, train_config
from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.data.chat import SFTConfig
from doel.train.data.prepare import prepare
from doel.train.data.textio import iter_documents
from doel.train.model import Llama, ModelConfig
from doel.train.optim import build_optimizer, hidden_matrices
from doel.train.settings import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "bangla-0.4b" / "recipe.toml"
SAMPLE = ROOT / "train" / "sample"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("gpus", [1, 8, 16])
def test_the_shipped_recipe_trains_its_budget_bangla_first(tmp_path, gpus):
    recipe = load_recipe(RECIPE)
    one = make_plan(recipe, tmp_path).train_cfg
    cfg = make_plan(recipe, tmp_path, gpus=gpus).train_cfg
    per_step = cfg.tokens_per_step * gpus
    assert per_step == one.tokens_per_step  # the global batch does not depend on the GPUs
    # The batch ramp splits a GPU's micro-batches; at one a GPU (16 GPUs) it is off.
    assert cfg.batch_ramp_fraction == (one.batch_ramp_fraction if cfg.grad_accum > 1 else 0)
    assert recipe.token_budget <= cfg.steps * per_step < recipe.token_budget + per_step
    assert cfg.model.vocab_size == recipe.tokenizer.vocab_size == 32768
    assert (cfg.dtype, cfg.compile) == ("bfloat16", True)
    bangla = sum(s.share for s in recipe.sources if s.language == "bn")
    assert bangla > 0.5 and {"int4", "int8"} <= set(recipe.export.quants)
    assert sum(recipe.corpus_chars.values()) >= recipe.token_budget * 4 - len(recipe.sources)


def test_the_shipped_recipe_fine_tunes_for_chat_on_bangla_hub_data(tmp_path):
    recipe = load_recipe(RECIPE)
    plan = make_plan(recipe, tmp_path)
    assert recipe.sft.enabled and all(d.startswith("hf:") for d in recipe.sft.data)
    cfg = load_config(SFTConfig, plan.preset, list(recipe.sft.set))  # valid on the preset
    assert cfg.prompt_field and cfg.keep_rows.endswith("=ben") and cfg.skip_malformed
    assert cfg.seq_len <= plan.train_cfg.model.max_position_embeddings
    dry = load_recipe(RECIPE, dry_run=True)
    sets = [*dry.sft.set, *dry.sft.dry_run_set]  # the dry run's, on the tiny preset
    cfg = load_config(SFTConfig, make_plan(dry, tmp_path, dry_run=True).preset, sets)
    assert cfg.device == "cpu" and cfg.steps < 10


def test_the_dry_run_is_the_same_recipe_at_tiny_scale(tmp_path):
    real, dry = load_recipe(RECIPE), load_recipe(RECIPE, dry_run=True)
    assert [(s.name, s.dataset, s.share) for s in dry.sources] == [
        (s.name, s.dataset, s.share) for s in real.sources
    ]
    cfg = make_plan(dry, tmp_path, dry_run=True).train_cfg
    assert (cfg.device, cfg.model.hidden_size, cfg.model.vocab_size) == ("cpu", 64, 512)
    assert cfg.steps * cfg.tokens_per_step >= dry.token_budget


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("share = 0.40", "share = -0.40", "sangraha: share must be > 0"),
        ("share = 0.35", "share = 0.30", "shares add up to 0.95"),
        ("token_budget = 2_000_000_000", "token_budget = 0", "token_budget must be"),
        ('quants = ["int4", "int8"]', 'quants = ["int3"]', "quants: ['int3'] unknown"),
        ('periodic_task = "bn_tydiqa"', 'periodic_task = "mmlu"', "periodic_task 'mmlu'"),
        ("vocab_size = 32768", "vocab_size = 100", "vocab_size=100 is smaller"),
        ('name = "bangla-0.4b"', 'name = "bangla-0.4b"\ncolour = 1', "unknown config keys"),
    ],
)
def test_a_bad_recipe_is_refused_naming_the_field(tmp_path, old, new, message):
    text = RECIPE.read_text(encoding="utf-8")
    assert old in text
    (tmp_path / "recipe.toml").write_text(text.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(DoelError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_recipe(tmp_path / "recipe.toml")


def test_the_parameter_count_is_the_models():
    for cfg in (
        load_config(TrainConfig, ROOT / "configs" / "small.toml").model,
        ModelConfig(64, 96, 160, 3, 6, 2, 128, tie_word_embeddings=False),
    ):
        assert parameter_count(cfg) == Llama(cfg).num_parameters()


def test_a_muon_checkpoint_is_estimated_with_the_state_torch_keeps():
    """AdamW keeps two fp32 moments a parameter, torch's Muon one momentum buffer for each
    hidden matrix: the estimate's checkpoint is the weights plus the state the optimizer holds
    after a step, so a muon run needs 4 bytes less a hidden-matrix parameter."""
    est = {}
    for optimizer in ("adamw", "muon"):
        cfg = load_config(TrainConfig, ROOT / "configs" / "tiny.toml", [f"optimizer={optimizer}"])
        model = Llama(cfg.model)
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        kept = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k != "step")
        params = parameter_count(cfg.model)
        muon = hidden_matrix_count(cfg.model) if optimizer == "muon" else 0
        est[optimizer] = needs(params=params, muon_params=muon)
        assert est[optimizer]["verify"].disk == params * 4 + kept  # one checkpoint, exactly
    named = dict(model.named_parameters())
    hidden = sum(named[n].numel() for n in hidden_matrices(model))
    assert 0 < hidden == hidden_matrix_count(cfg.model) < params
    adamw, muon = est["adamw"]["train"], est["muon"]["train"]
    assert adamw.disk - muon.disk == 4 * hidden * (3 + 1)  # keep_checkpoints=3 + the latest
    assert adamw.ram - muon.ram == 4 * hidden
    assert "x 12 bytes" in adamw.why and "x 12 bytes" not in muon.why


def needs(**change):
    args = dict(
        chars={"bn": 4e9, "en": 4e9},
        languages={"bn": "bn", "en": "en"},
        chars_per_token=4.0,
        vocab_size=32768,
        params=400e6,
        keep_checkpoints=3,
        quants={"int4": True, "int8": False},
        tokenizer_chars=1e9,
        overlap_sample=64,
    )
    return estimate_needs(**(args | change))


def test_the_estimate_follows_the_budget_and_refuses_what_does_not_fit(tmp_path):
    base = needs()
    assert needs(chars={"bn": 8e9, "en": 8e9})["shards"].disk == 2 * base["shards"].disk
    uint32 = needs(vocab_size=70_000)["shards"].disk - base["shards"].disk
    assert uint32 == pytest.approx(2e9 * 2)  # 2 more bytes for each of the 2B tokens
    # The resume record holds the kept n-gram hashes: 8 bytes a token when all are kept.
    assert needs(overlap_sample=1)["shards"].disk > base["shards"].disk + 2e9 * 7
    assert needs(languages={"bn": "en", "en": "en"})["data"].disk < base["data"].disk
    extra = needs(keep_checkpoints=5)["train"].disk - base["train"].disk
    assert extra == pytest.approx(2 * 400e6 * 12)  # fp32 weights + two Adam moments each
    assert needs(quants={"int4": False})["export"].disk < base["export"].disk
    shards = base["shards"]
    check_stage("shards", shards, free=2 * shards.disk, ram=2 * shards.ram, where=tmp_path)
    with pytest.raises(DoelError, match=r"stage shards: needs about 4\.38 GB of disk .* free"):
        check_stage("shards", shards, free=1e6, ram=None, where=tmp_path)
    with pytest.raises(DoelError, match="GB of memory"):
        check_stage("shards", shards, free=2 * shards.disk, ram=1e6, where=tmp_path)


def test_a_muon_run_also_projects_adamws_quality_at_the_measured_token_ratio():
    m = {"mfu": None, "peak_memory_gb": None, "steps_timed": 5, "device": "cpu"}
    m |= {"dtype": "float32", "compile": False, "sec_per_step": 2.0, "tokens_per_s": 1000.0}
    p = projection(steps=3600, done=0, sec_per_step=2.0, gpus=1, price=3.0)
    assert "with Muon" not in format_projection(m, p, 10**9)
    line = format_projection(m, p, 10**9, "muon").splitlines()[-1]
    assert 0 < MUON_TOKEN_RATIO < 1
    assert f"{MUON_TOKEN_RATIO:.2f}x the tokens" in line and "CPU-scale projection" in line
    assert "$" not in line and "no saving is counted" in line  # a CPU-scale ratio, not dollars


def test_the_projection_names_what_it_includes_and_what_not():
    """The 0.4B preset's projection (issue 56, item 9): the steps and the validations it
    includes, the ramp's extra updates and the checkpoints it does not; CPU seconds say so."""
    cfg = load_config(TrainConfig, ROOT / "configs" / "bangla-0.4b.toml")
    m = {"mfu": None, "peak_memory_gb": None, "steps_timed": 5, "device": "cpu"}
    m |= {"dtype": "float32", "compile": False, "sec_per_step": 4.0, "tokens_per_s": 1000.0}
    e = overheads(cfg, 4.0, 390_000_000)
    assert e["validations"] == cfg.steps // cfg.eval_every == 15
    # 16 batches a validation, a third of a micro-batch's step time each
    assert e["validation_s"] == pytest.approx(15 * 16 * 4.0 / cfg.grad_accum / 3)
    assert e["ramp_steps"] == round(0.3 * cfg.steps) and e["ramp_extra_updates"] > 0
    assert e["checkpoints"] == cfg.steps // cfg.checkpoint_every
    p = projection(cfg.steps, 0, 4.0, 1, 3.0)
    text = format_projection(m, p, 2 * 10**9, "muon", e)
    assert "the time above is the steps alone" in text and "15 validations" in text
    assert f"{e['ramp_extra_updates']:,} extra optimizer updates" in text
    assert "checkpoints" in text and "not a GPU's time or price" in text


def test_the_projection_and_the_confirmation(capsys):
    p = projection(steps=3815, done=815, sec_per_step=3.0, gpus=8, price=3.0)
    assert p["remaining_s"] / p["total_s"] == pytest.approx(3000 / 3815)
    assert p["total_usd"] == pytest.approx(3815 * 3 / 3600 * 8 * 3)
    assert projection(3815, 0, 3.0, 1, 6.0)["total_usd"] == pytest.approx(p["total_usd"] / 4)
    confirm("train?", False, Tty("y\n"))
    confirm("train?", True, io.StringIO(""))  # --yes needs nobody to answer
    with pytest.raises(DoelError, match="not confirmed"):
        confirm("train?", False, Tty("\n"))
    with pytest.raises(DoelError, match="pass --yes"):
        confirm("train?", False, io.StringIO("y\n"))  # a pipe: nobody can answer


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs), encoding="utf-8")
    return path


class Interrupted(Exception):
    pass


def stop_at(n):
    def hook(chunks):
        if chunks == n:
            raise Interrupted

    return hook


def files(folder: Path, pattern: str = "chunk-*") -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob(pattern)}


def resumes_like_a_whole_download(tmp_path, src, local, data):
    whole = fetch_source(src, 3000, tmp_path / "whole", data, local, log=lambda *a: None)
    with pytest.raises(Interrupted):
        fetch_source(src, 3000, tmp_path / "cut", data, local, lambda *a: None, stop_at(2))
    cut = tmp_path / "cut" / src.name
    marker = json.loads((cut / "progress.json").read_text())
    assert marker["chunks"] == 2 and not marker["done"]
    # What a kill in the middle of the third chunk leaves: a temporary file, a half chunk.
    (cut / ".chunk-00002.jsonl.abc.tmp").write_text('{"text": "half')
    (cut / "chunk-00002.jsonl").write_text('{"text": "half a chunk"}\n')
    first = (cut / "chunk-00000.jsonl").stat().st_mtime_ns
    again = fetch_source(src, 3000, tmp_path / "cut", data, local, log=lambda *a: None)
    assert files(tmp_path / "cut") == files(tmp_path / "whole")
    assert not list(cut.glob(".*.tmp"))
    assert (cut / "chunk-00000.jsonl").stat().st_mtime_ns == first  # not fetched again
    keys = ("documents", "chars", "heldout_chars", "chunks", "done")
    assert {k: again[k] for k in keys} == {k: whole[k] for k in keys}
    assert whole["done"] and whole["chars"] >= 3000 and whole["heldout_chars"] > 0
    return whole


def test_an_interrupted_download_continues_where_it_stopped(tmp_path):
    docs = [f"document {i}: " + "নদীর ধারে একটি গ্রাম। " * (3 + i % 5) for i in range(200)]
    path = write_jsonl(tmp_path / "web.jsonl", docs, field="body")
    src = HubSource("web", "owner/web", 1.0, text_field="body")
    data = DataSpec(heldout_every=7, chunk_chars=500)
    whole = resumes_like_a_whole_download(tmp_path, src, str(path), data)
    chunks = sorted((tmp_path / "whole" / "web-heldout").iterdir())
    held = [d for f in chunks for d in iter_documents(str(f), "text")]
    assert held == [docs[i - 1].strip() for i in range(7, whole["documents"] + 1, 7)]


def test_a_local_file_without_the_text_field_names_the_recipe_entry(tmp_path):
    path = write_jsonl(tmp_path / "web.jsonl", ["নদীর ধারে একটি গ্রাম।"] * 5, field="body")
    src = HubSource("web", "owner/web", 1.0)  # text_field "text"
    with pytest.raises(DoelError) as e:
        fetch_source(src, 3000, tmp_path / "out", DataSpec(), str(path), log=lambda *a: None)
    assert str(e.value) == (
        f"{path}:1: no 'text' field (found ['body']); set text_field = \"NAME\" in the "
        "recipe's [[sources]] entry 'web'"
    )


def test_the_hub_stream_resumes_from_its_own_position(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets")
    docs = [f"row {i} " + "The river runs past the village. " * (2 + i % 4) for i in range(150)]
    path = write_jsonl(tmp_path / "rows.jsonl", docs)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    src = HubSource("hub", "json", 1.0, language="en", data_files=str(path))
    whole = resumes_like_a_whole_download(
        tmp_path, src, None, DataSpec(heldout_every=5, chunk_chars=400)
    )
    assert whole["stream_state"]  # the datasets library's own position, not a row count


def write_tydiqa(path: Path, passages: list[str]) -> Path:
    data = []
    for i, p in enumerate(passages):
        qa = {"id": f"q{i}", "question": "কী?", "answers": [{"text": " ".join(p.split()[:2])}]}
        data.append({"paragraphs": [{"context": p, "qas": [qa]}]})
    path.write_text(json.dumps({"data": data}, ensure_ascii=False), encoding="utf-8")
    return path


def write_arc(path: Path, sentences: list[str]) -> Path:
    """llm-foundry's multiple-choice JSONL: query, choices, gold."""
    n = len(sentences)
    rows = [
        {"query": s, "choices": [sentences[(i + k) % n] for k in range(4)], "gold": 0}
        for i, s in enumerate(sentences)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Local files with the hub sources' schema: .jsonl and .parquet with a `text` field, .txt
    paragraphs; and two task files. Each source gets its own paragraphs."""
    folder = tmp_path_factory.mktemp("standins")
    bn = list(iter_documents(str(SAMPLE / "bn.txt")))
    en = list(iter_documents(str(SAMPLE / "en.txt")))
    out = {
        "sangraha": write_jsonl(folder / "sangraha.jsonl", bn[0:16]),
        "wikipedia-bn": folder / "wiki.txt",
        "fineweb-edu": write_jsonl(folder / "edu.jsonl", en[:36]),
        "bn_tydiqa": write_tydiqa(folder / "tydiqa.json", bn[30:36]),
        "arc_easy": write_arc(folder / "arc.jsonl", [s.split(".")[0] for s in en[36:]]),
    }
    out["wikipedia-bn"].write_text("\n\n".join(bn[25:30]) + "\n", encoding="utf-8")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        out["fineweb2-bn"] = folder / "fineweb2.parquet"
        pq.write_table(pa.table({"text": bn[16:25], "id": list(range(9))}), out["fineweb2-bn"])
    except ModuleNotFoundError:  # the train extra brings pyarrow; without it, JSONL
        out["fineweb2-bn"] = write_jsonl(folder / "fineweb2.jsonl", bn[16:25])
    # One TituLLM hub set in its own columns (hishab/piqa-bn: goal, sol1, sol2, label).
    piqa = [
        {"goal": bn[i][:60], "sol1": bn[i + 6][:60], "sol2": bn[i + 12][:60], "label": i % 2}
        for i in range(6)
    ]
    out["piqa_bn"] = folder / "piqa_bn.jsonl"
    out["piqa_bn"].write_text("".join(json.dumps(r) + "\n" for r in piqa), encoding="utf-8")
    return {k: str(v) for k, v in out.items()}


def dry_plan(out: Path, stand_ins: dict, *sets: str):
    recipe = load_recipe(RECIPE, list(sets), dry_run=True)
    # int4 with its ORT model is the bundle phones run; int8 adds time, not coverage.
    recipe = dataclasses.replace(
        recipe, export=dataclasses.replace(recipe.export, quants=("int4",))
    )
    return make_plan(recipe, out, dry_run=True, yes=True, local=stand_ins)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, stand_ins):
    out = tmp_path_factory.mktemp("dry") / "run"
    plan = dry_plan(out, stand_ins)
    logs: list[str] = []
    summary = run_recipe(plan, log=logs.append)
    return plan, summary, logs


def test_the_dry_run_goes_from_local_files_to_a_bundle_and_a_summary(dry_run, stand_ins):
    plan, s, _ = dry_run
    out = plan.out
    assert set(s) == {
        "recipe", "dry_run", "hardware", "gpus", "nodes", "stages", "wall_seconds", "training",
        "cost", "data", "eval", "exports", "artifacts",
    }  # fmt: skip
    assert (s["nodes"], s["hardware"]) == (1, "1 × cpu")
    stages = ["data", "tokenizer", "shards", "verify", "train", "eval", "sft", "export"]
    assert list(s["stages"]) == stages
    assert all(m["done"] and m["attempts"] == 1 for m in s["stages"].values())
    cfg = plan.train_cfg
    assert s["training"]["steps"] == cfg.steps
    assert s["training"]["tokens"] == cfg.steps * cfg.tokens_per_step
    assert s["training"]["tokens_per_s"] > 0 and s["training"]["projection"]["steps"] == cfg.steps
    assert s["cost"]["total_usd"] > s["cost"]["training_usd"] > 0
    assert not any(x["short"] for x in s["data"].values())  # every stand-in had enough text
    for lang in ("bn", "en"):  # four steps already beat the random twin on held-out text
        x = s["eval"]["languages"][lang]
        assert x["bits_per_char"] < x["random_twin_bits_per_char"]
    # The hub set with a stand-in is fetched and scored; the others, offline, are left out.
    assert set(s["eval"]["tasks"]) == {"bn_tydiqa", "arc_easy", "piqa_bn"}
    fetched = json.loads((out / "data/tasks.json").read_text())
    assert fetched["found"] == {
        "piqa_bn": str(out / "data/tasks/hishab__piqa-bn--validation.jsonl")
    }
    assert set(fetched["missing"]) == {
        "bangla_mmlu",
        "boolq_bn",
        "commonsenseqa_bn",
        "openbookqa_bn",
    }
    for path in (
        "tokenizer/tokenizer.json",
        "tokenizer/fertility.json",
        "shards/meta.json",
        "verify/verify.json",
        "run/final/model.safetensors",
        "sft/final/model.safetensors",  # the chat model, fine-tuned on the shipped sample
        "bundle-int4/manifest.json",
        "bundle-int4/model.ort",
        "summary.md",
        "recipe.json",
    ):
        assert (out / path).is_file(), path
    assert "Held-out bits per character" in (out / "run/final/README.md").read_text("utf-8")
    # The bundles are of the chat model, and carry its template.
    assert s["artifacts"]["chat_model"] == str(out / "sft" / "final")
    assert "chat.jsonl" in (out / "sft/final/README.md").read_text("utf-8")
    assert json.loads((out / "bundle-int4/tokenizer_config.json").read_text())["chat_template"]
    meta = json.loads((out / "shards/meta.json").read_text())
    assert meta["sources"]["fineweb2-bn"]["requested_char_share"] == pytest.approx(0.2)
    assert meta["sources"]["sangraha"]["paths"][0].startswith(str(out / "data"))
    rows = [json.loads(x) for x in (out / "run/metrics.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows if r["kind"] == "task"} == {"bn_tydiqa"}  # periodic
    progress = json.loads((out / "data/fineweb2-bn/progress.json").read_text())
    assert progress["source"]["local"] == stand_ins["fineweb2-bn"]


def test_a_rerun_skips_every_completed_stage(dry_run, stand_ins):
    plan, first, _ = dry_run
    watched = ["tokenizer/tokenizer.json", "shards/meta.json", "run/final/model.safetensors"]
    watched += ["bundle-int4/manifest.json", "data/sangraha/chunk-00000.jsonl"]
    before = {p: (plan.out / p).stat().st_mtime_ns for p in watched}
    logs: list[str] = []
    # A new price changes no artifact: everything is skipped, the dollars follow the price.
    again = run_recipe(dry_plan(plan.out, stand_ins, "hourly_price=6"), log=logs.append)
    for stage in first["stages"]:
        assert any(line.startswith(f"[{stage}] complete") for line in logs), stage
    assert {p: (plan.out / p).stat().st_mtime_ns for p in watched} == before
    assert again["stages"] == first["stages"]
    assert again["cost"]["total_usd"] == pytest.approx(2 * first["cost"]["total_usd"])


def test_an_interrupted_data_stage_resumes_and_counts_both_attempts(tmp_path, dry_run, stand_ins):
    plan = dry_plan(tmp_path / "run", stand_ins)
    with pytest.raises(Interrupted):
        run_recipe(plan, until="data", log=lambda *a: None, on_chunk=stop_at(1))
    mark = json.loads((plan.out / "stages" / "data.json").read_text())
    assert (mark["done"], mark["attempts"]) == (False, 1)
    run_recipe(plan, until="data", log=lambda *a: None)
    mark = json.loads((plan.out / "stages" / "data.json").read_text())
    assert (mark["done"], mark["attempts"]) == (True, 2)
    assert files(plan.out / "data") == files(dry_run[0].out / "data")  # as if never stopped


def test_an_interrupted_shards_stage_resumes_to_the_same_shards(tmp_path, stand_ins, monkeypatch):
    import doel.train.data.prepare as prep

    # Small batches and shards, so that the stage stops with shards finished and one open.
    plan = dry_plan(
        tmp_path / "run", stand_ins, "prepare.shard_tokens=300", "prepare.batch_chars=400"
    )
    write, calls = prep._Run.write, []

    def stop_at_the_fourth_batch(self, batch, encs):
        calls.append(1)
        if len(calls) == 4:
            raise Interrupted
        return write(self, batch, encs)

    monkeypatch.setattr(prep._Run, "write", stop_at_the_fourth_batch)
    with pytest.raises(Interrupted):
        run_recipe(plan, until="shards", log=lambda *a: None)
    monkeypatch.undo()
    shards = plan.out / "shards"
    assert (shards / "prepare_state" / "record.json").is_file()
    logs: list[str] = []
    run_recipe(plan, until="shards", log=logs.append)
    mark = json.loads((plan.out / "stages" / "shards.json").read_text())
    assert (mark["done"], mark["attempts"]) == (True, 2)
    assert any(line.startswith("prepare: resuming after") for line in logs)
    c = RecipeRun(plan).corpus()
    args = (c["train"], tmp_path / "whole", plan.recipe.prepare, c["weights"], c["heldout_dirs"])
    meta = prepare(plan.out / "tokenizer", *args, progress=False, log=lambda *a: None)
    assert len(meta["splits"]["train"]["shards"]) > 3
    assert files(shards, "*.bin") == files(tmp_path / "whole", "*.bin")  # as if never stopped


def test_a_changed_setting_redoes_its_stage_and_the_ones_after_it(tmp_path, stand_ins):
    def fingerprints(*sets, local=stand_ins):
        recipe = load_recipe(RECIPE, list(sets), dry_run=True)
        run = RecipeRun(make_plan(recipe, tmp_path, dry_run=True, local=local))
        return {stage: run.fingerprint(stage) for stage in DEPENDS}

    def redone(*sets, **kw):
        new = fingerprints(*sets, **kw)
        return [stage for stage in DEPENDS if new[stage] != base[stage]]

    base = fingerprints()
    after_tokenizer = ["tokenizer", "shards", "verify", "train", "eval", "sft", "export"]
    assert redone("tokenizer.vocab_size=600") == after_tokenizer
    assert redone("data.heldout_every=6") == ["data", *after_tokenizer]
    assert redone("prepare.overlap_sample=2") == after_tokenizer[1:]
    assert redone("verify.parity_factor=6") == ["verify"]
    assert redone("token_budget=2048") == ["data", *after_tokenizer]  # more steps, more text
    assert redone("export.eval_tokens=300") == ["export"]
    assert redone("sft.enabled=false") == ["sft", "export"]  # the bundles hold the base model
    assert redone("hourly_price=9", "train.measure_steps=5") == []  # no artifact changes
    # Another file for the task scored during training too: only the evaluation is redone.
    assert redone(local=stand_ins | {"bn_tydiqa": stand_ins["arc_easy"]}) == ["eval"]
    # Another stand-in for a hub task set: only the evaluation is redone.
    assert redone(local=stand_ins | {"piqa_bn": stand_ins["arc_easy"]}) == ["eval"]


def test_a_model_trained_further_redoes_the_stages_that_read_it(tmp_path, stand_ins):
    """Issue 38.6: the base's weights (by the sha256 its checksums.json records) enter the
    fingerprints of eval, sft and export; the chat model's, export's."""
    recipe = load_recipe(RECIPE, dry_run=True)
    run = RecipeRun(make_plan(recipe, tmp_path, dry_run=True, local=stand_ins))

    def weights(folder: Path, sha: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        files = {"model.safetensors": {"bytes": 1, "sha256": sha}}
        record = {"format": "doel-checksums", "version": 1, "files": files}
        (folder / "checksums.json").write_text(json.dumps(record))

    def redone(change) -> list[str]:
        before = {stage: run.fingerprint(stage) for stage in DEPENDS}
        change()
        return [stage for stage in DEPENDS if run.fingerprint(stage) != before[stage]]

    weights(tmp_path / "run" / "final", "a" * 64)
    weights(tmp_path / "sft" / "final", "c" * 64)
    base, chat = tmp_path / "run" / "final", tmp_path / "sft" / "final"
    assert redone(lambda: weights(base, "b" * 64)) == ["eval", "sft", "export"]
    assert redone(lambda: weights(chat, "d" * 64)) == ["export"]
    assert redone(lambda: None) == []


def test_too_little_disk_stops_before_anything_is_written(tmp_path, stand_ins):
    plan = dry_plan(tmp_path / "run", stand_ins)
    with pytest.raises(DoelError, match=r"needs about .* GB of disk .* 0\.00 GB free"):
        run_recipe(plan, log=lambda *a: None, probe_fn=lambda path: (1000.0, None))
    assert not (tmp_path / "run" / "data").exists()


def test_the_torchrun_command_trains_the_plans_config(tmp_path):
    plan = make_plan(load_recipe(RECIPE), tmp_path, gpus=8)
    cmd = torchrun_command(plan, tmp_path / "shards", tmp_path / "run", tmp_path / "tok.json")
    script = cmd.index("--no-python") + 1  # torchrun runs the console script, not `-m train`
    assert "--nproc_per_node=8" in cmd and Path(cmd[script]).name == "doel-train"
    assert Path(cmd[0]).name == "torchrun" and "-m" not in cmd
    args = build_parser().parse_args(cmd[script + 1 :])
    assert train_config(args) == plan.train_cfg
    assert (
        plan.train_cfg.grad_accum * 8
        == make_plan(load_recipe(RECIPE), tmp_path).train_cfg.grad_accum
    )


DECOY = "raise SystemExit('a train.py in the working directory ran instead of doel')\n"


@pytest.mark.slow
def test_the_torchrun_launch_trains_doel_from_a_folder_holding_a_decoy_train_py(
    tmp_path, shards, tokenizer_path
):
    """`python -m train` from this folder runs the decoy (a bare name's hazard, which doel's
    installed name `doel.train` is free of); the recipe's launch still trains."""
    (tmp_path / "train.py").write_text(DECOY, encoding="utf-8")
    old = subprocess.run(
        [sys.executable, "-m", "train", "fit", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "ran instead of doel" in old.stderr  # the hazard is real here
    ours = subprocess.run(
        [sys.executable, "-m", "doel.train", "fit", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert ours.returncode == 0 and "ran instead of doel" not in ours.stdout + ours.stderr
    recipe = load_recipe(RECIPE, ["tokenizer.vocab_size=2048"], dry_run=True)
    plan = make_plan(recipe, tmp_path / "out", dry_run=True, gpus=2)
    run = tmp_path / "out" / "run"
    cmd = torchrun_command(plan, shards, run, tokenizer_path)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran instead of doel" not in proc.stdout + proc.stderr
    assert (run / "final" / "model.safetensors").is_file()
    assert json.loads((run / "final" / "train_config.json").read_text()) == dataclasses.asdict(
        plan.train_cfg
    )


def test_without_a_terminal_it_refuses_to_train_but_prepares_data(tmp_path, monkeypatch, stand_ins):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    local = [f"--local={k}={v}" for k, v in stand_ins.items()]
    args = ["recipe", "--dry-run", "--out", str(tmp_path / "r"), *local]
    with pytest.raises(SystemExit, match="pass --yes"):
        main(args)
    assert not (tmp_path / "r" / "data").exists()
    main([*args, "--until", "shards"])  # no training, no question
    assert (tmp_path / "r" / "shards" / "meta.json").is_file()
    assert not (tmp_path / "r" / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_gpu_slice_refuses_clearly_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs? .*CUDA|CUDA GPU"):
        main(["recipe", "--gpu-slice", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
