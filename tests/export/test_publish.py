"""Publishing with huggingface_hub's own `hf upload` (issue 17, item 4): an export bundle carries
a README.md model card that `huggingface_hub.ModelCard` parses, whose metadata and body say what
the Hub and a reader need (library, languages, license, base model, the upload line, the parity
figures of manifest.json); `--repo-id` fills the card's repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from doel.export.card import Target, check_repo_id, gguf_card, onnx_card, parity_rows
from doel.export.cli import main as export_main
from doel.export.common import ExportError

ModelCard = pytest.importorskip("huggingface_hub").ModelCard


def _manifest(**parity_extra) -> dict:
    """The parts of export_checkpoint's manifest the card reads, with figures of our choosing."""
    return {
        "engine": "genai",
        "architecture": "LlamaForCausalLM",
        "context_length": 2048,
        "mobile_model": None,
        "quantization": {"scheme": "int4"},
        "source": {"folder": "final"},
        "parity": {
            "logits_vs_torch": {"max_rel_err": 0.21, "top1_agreement": 0.97, "bound": None},
            "kv_cache_vs_full": {"max_rel_err": 3.5e-6, "bound": 2.1e-2},
            "loss": {
                "tokens": 4096,
                "increase_nats_per_token": 0.0123,
                "bound_nats_per_token": 0.1,
            },
            **parity_extra,
        },
    }


def test_the_bundle_card_is_a_hub_model_card_with_the_repo_and_base_model():
    to = Target("bundle-int4", "ann/doel-int4-onnx", "ann/doel-bangla-0.4b")
    text = onnx_card(_manifest(), to)
    card = ModelCard(text)
    data = card.data.to_dict()
    assert data["library_name"] == "onnxruntime"
    assert data["language"] == ["bn", "en"]
    assert data["license"] == "apache-2.0"
    assert data["base_model"] == ["ann/doel-bangla-0.4b"]
    assert data["pipeline_tag"] == "text-generation"
    assert {"onnx", "int4", "doel", "llama"} <= set(data["tags"])
    assert "genai_config.json" in card.text  # the builder's graph runs in onnxruntime-genai
    assert "hf upload ann/doel-int4-onnx bundle-int4\n" in card.text
    assert "hf download ann/doel-int4-onnx --local-dir bundle-int4" in card.text
    assert "doel-serve bundle-int4" in card.text
    assert "YOUR-NAME" not in text


def test_without_a_repo_id_the_card_names_a_placeholder_and_no_base_model():
    text = onnx_card(_manifest(), Target("bundle-int4", license="mit"))
    data = ModelCard(text).data.to_dict()
    assert "base_model" not in data and data["license"] == "mit"
    assert "hf upload YOUR-NAME/bundle-int4 bundle-int4\n" in text
    assert "The checkpoint `final`" in text  # by its folder's name instead


def test_the_card_shows_every_parity_figure_with_its_bound():
    ort = {"max_rel_err": 2e-7, "bound": 1e-5}
    rows = parity_rows(_manifest(ort_format_vs_onnx=ort)["parity"])
    table = "\n".join(rows)
    assert "| 0.21 | n/a |" in table  # quantized logits: no bound, the loss is the check
    assert "| 0.97 |" in table
    assert "| 3.5e-06 | 0.021 |" in table
    assert "over 4,096 tokens, nats/token | 0.0123 | 0.1 |" in table
    assert "| 2e-07 | 1e-05 |" in table
    assert len(rows) == 2 + 5


@pytest.mark.parametrize(
    "bad", ["", "a/b/c", "ann/", "/x", "ann/x--y", "ann/x..y", "ann/-x", "ann/x.", "ann/x y"]
)
def test_a_bad_repo_id_is_refused_in_one_line(bad, capsys, tmp_path):
    with pytest.raises(ExportError, match="not a Hugging Face repository id"):
        check_repo_id(bad)
    # From the command line: one line, before any work, nothing written.
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path), "--out", str(tmp_path / "b"), "--repo-id", bad])
    assert "not a Hugging Face repository id" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("good", ["ann/doel-bangla-0.4b", "doel_int4.onnx", "A1/b"])
def test_good_repo_ids_pass(good):
    assert check_repo_id(good) == good


def _load(path: Path) -> ModelCard:
    return ModelCard.load(path)  # a local file: what the Hub shows of the folder's README.md


def test_a_bundle_is_a_hub_model_repo_on_its_own(tiny_bundle):
    manifest = json.loads((tiny_bundle / "manifest.json").read_text(encoding="utf-8"))
    card = _load(tiny_bundle / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "onnxruntime" and data["language"] == ["bn", "en"]
    assert "base_model" not in data  # its checkpoint has no doel card naming a repository
    assert f"hf upload YOUR-NAME/{tiny_bundle.name} {tiny_bundle.name}\n" in card.text
    loss = manifest["parity"]["loss"]
    assert f"| {loss['increase_nats_per_token']:.3g} |" in card.text
    assert "README.md" in manifest["files"]  # hashed with the rest


def test_repo_id_and_the_checkpoints_recorded_repo_fill_the_card(tiny_bundle, tmp_path):
    ckpt = tmp_path / "final"
    shutil.copytree(tiny_bundle.parent / "serve-ckpt", ckpt)
    # What `doel-train eval --repo-id` records beside the checkpoint's own card.
    inputs = {"license": "cc-by-4.0", "repo_id": "ann/doel-tiny"}
    (ckpt / "model_card.json").write_text(json.dumps(inputs), encoding="utf-8")
    out = tmp_path / "bundle"
    argv = [str(ckpt), "--out", str(out), "--quant", "fp32", "--eval-tokens", "64"]
    export_main([*argv, "--repo-id", "ann/doel-tiny-onnx"])
    data = _load(out / "README.md").data.to_dict()
    assert data["base_model"] == ["ann/doel-tiny"] and data["license"] == "cc-by-4.0"
    assert "hf upload ann/doel-tiny-onnx bundle\n" in (out / "README.md").read_text("utf-8")


def test_the_gguf_card_says_gguf_and_how_llama_cpp_and_ollama_run_it():
    manifest = {"kind": "gguf", "quant": "q8_0", "gguf": "model-q8_0.gguf", "pre_tokenizer": "x"}
    text = gguf_card(manifest, Target("gguf-q8"))
    data = ModelCard(text).data.to_dict()
    assert data["library_name"] == "gguf" and data["language"] == ["bn", "en"]
    assert "base_model" not in data and {"gguf", "q8_0"} <= set(data["tags"])
    assert "hf upload YOUR-NAME/gguf-q8 gguf-q8\n" in text
    assert (
        "llama-server -hf YOUR-NAME/gguf-q8" in text
        and "ollama run hf.co/YOUR-NAME/gguf-q8" in text
    )
    assert "`model-q8_0.gguf`" in text and "chat template" not in text


@pytest.mark.slow
def test_a_gguf_folder_is_a_hub_model_repo_on_its_own(tmp_path, sample_paths, tiny_model_config):
    pytest.importorskip("gguf")
    torch = pytest.importorskip("torch")
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama

    cfg = TokenizerConfig(vocab_size=tiny_model_config.vocab_size, min_frequency=1, style="gguf")
    tok = train_tokenizer(resolve_sources(sample_paths), cfg, tmp_path / "tok", progress=False)
    torch.manual_seed(0)
    ckpt = save_model(Llama(tiny_model_config), tmp_path / "final", tokenizer=tok)
    inputs = {"license": "mit", "repo_id": "ann/doel-tiny"}  # as doel-train eval --repo-id left it
    (ckpt / "model_card.json").write_text(json.dumps(inputs), encoding="utf-8")
    out = tmp_path / "gguf-q8"
    argv = [str(ckpt), "--out", str(out), "--format", "gguf", "--quant", "q8_0"]
    export_main([*argv, "--repo-id", "ann/doel-tiny-gguf"])
    card = _load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "gguf" and data["base_model"] == ["ann/doel-tiny"]
    assert data["license"] == "mit" and "q8_0" in data["tags"]
    assert "hf upload ann/doel-tiny-gguf gguf-q8\n" in card.text
    assert "`model-q8_0.gguf`" in card.text
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert "README.md" in manifest["files"] and "model-q8_0.gguf" in manifest["files"]


def _import_record(folder: Path, **source) -> None:
    """import.json as `doel-train import` writes it beside an imported model."""
    record = {"format": "doel-import", "version": 1, "source": {"kind": "gguf", **source}}
    (folder / "import.json").write_text(json.dumps(record), encoding="utf-8")


def test_an_imported_models_card_names_where_it_came_from_not_doel(tmp_path):
    from doel.export.card import write_card

    _import_record(
        tmp_path,
        name="Smol.Q4_1.gguf",
        model_name="Smol 135M",
        organization="Someone",
        license="apache-2.0",
    )
    text = write_card(tmp_path, _manifest(), "bundle", tmp_path, None).read_text("utf-8")
    assert "trained with doel" not in text
    assert "`Smol 135M` by Someone, imported with `doel-train import` from `Smol.Q4_1.gguf`" in text
    assert ModelCard(text).data.to_dict()["license"] == "apache-2.0"  # the model's, not doel's
    gguf = {"kind": "gguf", "quant": "q8_0", "gguf": "m.gguf", "pre_tokenizer": "smollm"}
    assert "trained with doel" not in write_card(tmp_path, gguf, "g", tmp_path, None).read_text()


def test_an_imported_model_of_unknown_license_is_not_given_doels(tmp_path):
    from doel.export.card import write_card

    _import_record(tmp_path, name="x.gguf")
    text = write_card(tmp_path, _manifest(), "bundle", tmp_path, None).read_text("utf-8")
    assert ModelCard(text).data.to_dict()["license"] == "other"
    (tmp_path / "import.json").unlink()  # a checkpoint doel trained: doel's wording and license
    text = write_card(tmp_path, _manifest(), "bundle", tmp_path, None).read_text("utf-8")
    assert "trained with doel" in text and ModelCard(text).data.to_dict()["license"] == "apache-2.0"
