"""doel.contracts: the quantization table is the one place a format is described, and every step
that interprets a format (the export command line, ExportOptions, the block fit, parity, the
recipe's spec and budget) reads it, so a row added here reaches them all; the manifest is a
typed, versioned record that reads back what export writes and the bundles of version 1, and
refuses any other folder in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from doel.contracts.manifest import VERSION, KVCache, Manifest, ManifestError, read_manifest
from doel.contracts.quant import QUANTS, Quant, at_bits, names, quant

pytest.importorskip("onnxruntime")

from doel.export.bundle import ExportOptions, fit_block, head_choices  # noqa: E402
from doel.export.cli import build_parser  # noqa: E402
from doel.export.common import ExportError  # noqa: E402
from doel.export.parity import check, kv_bound  # noqa: E402

# A format the table does not hold: int4 in blocks of 64 with its own loss bound and size.
NEW = Quant("int4b64", "onnx", 4, 64, 8, 0.05, 0.9, "q4_0")


def _quant_action():
    return next(a for a in build_parser()._actions if a.dest == "quant")


def _figures(increase: float) -> dict:
    return {
        "logits_vs_torch": {"max_rel_err": 0.05},
        "kv_cache_vs_full": {"max_rel_err": 0.0},
        "loss": {"increase_nats_per_token": increase, "increase_bits_per_char": increase / 3},
    }


# ---------------------------------------------------------------- the quantization table


def test_the_targets_split_the_table_and_each_has_its_default():
    from doel.contracts.quant import DEFAULT_GGUF, DEFAULT_ONNX, GGUF_QUANTS, ONNX_QUANTS

    assert set(ONNX_QUANTS) | set(GGUF_QUANTS) == set(QUANTS)
    assert not set(ONNX_QUANTS) & set(GGUF_QUANTS)
    assert (names("onnx"), names("gguf")) == (ONNX_QUANTS, GGUF_QUANTS)
    assert quant(DEFAULT_ONNX, "onnx").quantized and quant(DEFAULT_GGUF, "gguf").quantized
    for row in QUANTS.values():
        # A quantized row's head is at least as fine as its body; a float row has no bound.
        assert row.quantized == (row.head_bits is not None), row.name
        assert row.head_bits is None or row.head_bits >= row.bits, row.name
        assert row.loss_bound is None or row.quantized, row.name
        # The GGUF head's bits name a GGUF row (the writer stores embedding and head in it).
        if row.target == "gguf" and row.quantized:
            assert at_bits(row.head_bits, "gguf").bits == row.head_bits


def test_a_name_the_target_does_not_make_is_refused_naming_its_choices():
    with pytest.raises(ValueError, match="choose from f32, f16, q8_0, q4_0"):
        quant("int4", "gguf")
    with pytest.raises(ValueError, match=", ".join(names("onnx"))):
        quant("q8_0", "onnx")
    with pytest.raises(ValueError, match="'int3' is not one doel makes"):
        quant("int3")
    with pytest.raises(ExportError, match="choose from fp32, int8, int4"):
        ExportOptions(quant="q4_0", log=None)


@pytest.mark.parametrize("name", names("onnx"))
def test_every_onnx_row_is_an_export_option_with_its_block_and_bound(name):
    row = QUANTS[name]
    opts = ExportOptions(quant=name, log=None)
    assert opts.quant == name and opts.head_bits is None  # None: the row's own head
    assert fit_block(name, (4096, 8192)) == row.block_size  # divides: taken as it is
    # parity's loss bound is the row's: just under passes, just over fails.
    if row.loss_bound is not None:
        check(_figures(row.loss_bound * 0.99), name, None)
        with pytest.raises(ExportError, match=f"bound {row.loss_bound} nats/token"):
            check(_figures(row.loss_bound * 1.01), name, None)
    assert (kv_bound(name, 0.05) == 0.05) == row.quantized  # quantized: the kernels' own gap


def test_the_command_line_offers_the_table():
    action = _quant_action()
    assert tuple(action.choices) == tuple(QUANTS)
    for name in QUANTS:
        assert name in action.help
    bits = next(a for a in build_parser()._actions if a.dest == "head_bits")
    assert tuple(bits.choices) == head_choices()
    assert set(head_choices()) == {QUANTS[n].bits for n in names("onnx") if QUANTS[n].quantized}


def test_a_row_added_to_the_table_reaches_every_consumer(monkeypatch):
    from doel.pipeline.budget import estimate_needs
    from doel.pipeline.spec import ExportSpec

    monkeypatch.setitem(QUANTS, NEW.name, NEW)
    assert NEW.name in _quant_action().choices and NEW.name in names("onnx")
    assert ExportOptions(quant=NEW.name, log=None).quant == NEW.name
    assert fit_block(NEW.name, (4096,)) == 64 and fit_block(NEW.name, (96,)) == 32
    check(_figures(0.049), NEW.name, None)
    with pytest.raises(ExportError, match="bound 0.05 nats/token"):
        check(_figures(0.051), NEW.name, None)
    assert ExportSpec(quants=(NEW.name,), mobile=()).quants == (NEW.name,)

    def export_disk(name: str) -> float:
        args = dict(
            chars={"bn": 1e6}, languages={"bn": "bn"}, chars_per_token=4.0, vocab_size=8192,
            params=1e6, keep_checkpoints=1, quants={name: False}, tokenizer_chars=1e6,
            overlap_sample=64,
        )  # fmt: skip
        return estimate_needs(**args)["export"].disk

    # The bundle's bytes a parameter are the row's: the difference to int4 is theirs.
    gap = export_disk(NEW.name) - export_disk("int4")
    assert gap == pytest.approx(1e6 * (NEW.bytes_per_param - QUANTS["int4"].bytes_per_param))


def test_a_changed_row_changes_what_parity_allows(monkeypatch):
    looser = dataclasses.replace(QUANTS["int8"], loss_bound=0.5)
    with pytest.raises(ExportError, match="bound 0.02"):
        check(_figures(0.3), "int8", None)
    monkeypatch.setitem(QUANTS, "int8", looser)
    check(_figures(0.3), "int8", None)


def test_the_recipe_takes_only_onnx_rows():
    from doel.pipeline.spec import ExportSpec

    with pytest.raises(ValueError, match=r"quants: \['q8_0'\] unknown"):
        ExportSpec(quants=("q8_0",), mobile=())


# ---------------------------------------------------------------- the manifest


def _onnx(**change) -> Manifest:
    kv = KVCache(layers=2, kv_heads=2, head_dim=16, past_present_share_buffer=True)
    fields = dict(
        kind="onnx",
        model="model.onnx",
        quant="int4",
        vocab_size=2048,
        context_length=256,
        kv_cache=kv,
        special_tokens={"eos": {"id": 1, "token": "<|eos|>"}},
        extra={"quantization": {"scheme": "int4 weight-only, MatMulNBits"}, "engine": "genai"},
    )
    return Manifest(**(fields | change))


def test_a_manifest_round_trips_through_json_keeping_unknown_keys(tmp_path):
    m = _onnx()
    data = json.loads(json.dumps(m.to_dict()))
    assert data["format"] == "doel-export" and data["format_version"] == VERSION
    assert data["kind"] == "onnx" and data["engine"] == "genai"  # extra keys at the top level
    assert data["kv_cache"]["past_present_share_buffer"] is True
    assert Manifest.from_dict(data) == m
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path) == m
    g = Manifest(kind="gguf", gguf="model-q8_0.gguf", quant="q8_0", extra={"tensors": {}})
    assert Manifest.from_dict(json.loads(json.dumps(g.to_dict()))) == g


def test_a_version_1_bundle_still_reads_as_an_onnx_bundle():
    data = _onnx().to_dict()
    data["format_version"] = 1
    del data["kind"], data["quant"]  # version 1 had neither
    m = Manifest.from_dict(data)
    assert (m.kind, m.version, m.model, m.kv_cache) == ("onnx", 1, "model.onnx", _onnx().kv_cache)
    assert m.extra["quantization"]["scheme"].startswith("int4")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format_version": VERSION + 1}, "newer than this doel reads.*pip install -U doel"),
        ({"format": "something-else"}, "is not a doel-export manifest"),
        ({"kind": "tflite"}, "kind 'tflite' unknown"),
        ({"kv_cache": {"layers": "two", "kv_heads": 2, "head_dim": 16}}, "is damaged"),
        ({"kv_cache": None}, "an onnx manifest needs model, kv_cache and vocab_size"),
        ({"kv_cache": [2, 2, 16]}, "is damaged"),  # not an object
        ({"quant": None, "quantization": "int4"}, "is damaged"),  # not an object either
    ],
)
def test_a_manifest_this_doel_cannot_use_is_refused_in_one_line(tmp_path, change, message):
    data = _onnx().to_dict() | change
    if data["kv_cache"] is None:
        del data["kv_cache"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message) as e:
        read_manifest(tmp_path)
    assert "\n" not in str(e.value)


def test_a_folder_without_a_readable_manifest_is_refused_in_one_line(tmp_path):
    with pytest.raises(ManifestError, match="has no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{cut")
    with pytest.raises(ManifestError, match="is not JSON"):
        read_manifest(tmp_path)
