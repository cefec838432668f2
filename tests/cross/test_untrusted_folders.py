"""Model folders from strangers (issue 48, 4): each hostile folder of tests/hostile_folders.py is
refused by doel-export or doel-serve in one line naming the field, before anything is allocated
by its claims (doel.contracts.untrusted, export/claims.py, serve/core/engine.py's
read_bundle), and a
refusal's peak memory is measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hostile_folders as h
import pytest

from doel.contracts import untrusted
from doel.export.checkpoint import inspect_checkpoint
from doel.export.common import ExportError
from doel.serve.core.engine import BundleError, read_bundle

ROOT = Path(__file__).resolve().parents[2]
MAX_RSS_MB = 200  # issue 48: a refusal's peak RSS


def _sequence(steps: list[dict]) -> dict:
    return {"type": "Sequence", "normalizers": steps}


# (hostile folder, what the one line says: the file and the field)
CHECKPOINTS = {
    "hidden_size disagrees": (
        lambda p: h.config_claims(p, hidden_size=32),
        "config.json hidden_size=32 disagrees with the weights: tensor 'model.embed_tokens.weight'"
        " is [64, 16]",
    ),
    "layers disagree": (
        lambda p: h.config_claims(p, num_hidden_layers=48),
        "config.json num_hidden_layers=48 disagrees with the weights: their tensors hold layers 0",
    ),
    "intermediate_size disagrees": (
        lambda p: h.config_claims(p, intermediate_size=64),
        "config.json intermediate_size=64 disagrees with the weights: tensor 'model.layers.0.mlp",
    ),
    "KV heads disagree": (
        lambda p: h.config_claims(p, num_key_value_heads=4),
        "config.json num_key_value_heads=4 disagrees with the weights",
    ),
    "a billion layers": (
        lambda p: h.config_claims(p, num_hidden_layers=10**9),
        "config.json num_hidden_layers is 1000000000, outside 1..1,024",
    ),
    "layers as 1e9": (
        lambda p: h.config_claims(p, num_hidden_layers=1e9),
        "config.json num_hidden_layers is 1000000000.0, not a whole number",
    ),
    "a vocabulary of 2^40": (
        lambda p: h.config_claims(p, vocab_size=2**40),
        "config.json vocab_size is 1099511627776, outside 1..1,048,576",
    ),
    "a huge width": (
        lambda p: h.config_claims(p, hidden_size=2**40),
        "config.json hidden_size is 1099511627776, outside",
    ),
    "a negative width": (
        lambda p: h.config_claims(p, hidden_size=-16),
        "config.json hidden_size is -16, outside",
    ),
    "a width as text": (
        lambda p: h.config_claims(p, hidden_size="16"),
        "config.json hidden_size is '16', not a whole number",
    ),
    "heads as true": (
        lambda p: h.config_claims(p, num_attention_heads=True),
        "config.json num_attention_heads is True, not a whole number",
    ),
    "an enormous config.json": (
        lambda p: h.replaced(p, "config.json", size=untrusted.MAX_RECORD_BYTES + 1),
        f"config.json is {untrusted.MAX_RECORD_BYTES + 1:,} bytes, more than the",
    ),
    "a config.json nested deep": (
        lambda p: h.replaced(p, "config.json", "[" * 100_000 + "]" * 100_000),
        "config.json is JSON nested too deep to read",
    ),
    "a tokenizer.json nested deep": (
        lambda p: h.replaced(
            p, "tokenizer.json", '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}"
        ),
        "tokenizer.json is JSON nested too deep to read",
    ),
    "a header longer than the file": (
        h.header_beyond_the_file,
        "model.safetensors is truncated or not a safetensors file: its header length (the first 8 "
        "bytes) is 4,611,686,018,427,387,904 bytes, more than the",
    ),
    "a huge header": (
        h.huge_header,
        f"model.safetensors header length (the first 8 bytes) is {17 * 2**20:,} bytes, more "
        f"than the {untrusted.MAX_SAFETENSORS_HEADER_BYTES:,} doel reads",
    ),
    "data_offsets beyond the file": (
        h.offsets_beyond_the_file,
        "(the data_offsets of tensor 'model.embed_tokens.weight' end at byte 1099511627776)",
    ),
    "an index naming ../": (
        h.index_out_of_the_folder,
        "model.safetensors.index.json weight_map is '../secret.safetensors', not the name of a",
    ),
    "an index naming an absolute path": (
        lambda p: h.index_out_of_the_folder(p, "/etc/passwd"),
        "model.safetensors.index.json weight_map is '/etc/passwd', not the name of a file",
    ),
    "millions of merges": (
        lambda p: h.tokenizer_merges(p, untrusted.MAX_VOCAB + 1),
        f"tokenizer.json model.merges has {untrusted.MAX_VOCAB + 1:,} entries",
    ),
    "a Sequence nested deep": (
        lambda p: h.tokenizer_normalizer(p, h.nested_sequence(untrusted.MAX_DEPTH)),
        f"tokenizer.json normalizer nests its steps {untrusted.MAX_DEPTH + 1} deep",
    ),
    "Replace steps that multiply the text": (
        lambda p: h.tokenizer_normalizer(p, _sequence([h.replace("a", "aa")] * 11)),
        "tokenizer.json normalizer: its Replace steps can make a text 2,048 times longer",
    ),
    "a huge regex": (
        lambda p: h.tokenizer_normalizer(p, h.replace("(a|b)" * 1000, "c", regex=True)),
        "tokenizer.json normalizer has a Regex of 5,000 characters",
    ),
    "hundreds of steps": (
        lambda p: h.tokenizer_normalizer(p, _sequence([{"type": "Lowercase"}] * 300)),
        "tokenizer.json normalizer, pre_tokenizer, post_processor and decoder have 301 steps",
    ),
    "an enormous tokenizer.json": (
        lambda p: h.huge_tokenizer(p, untrusted.MAX_TOKENIZER_BYTES + 1),
        f"tokenizer.json is {untrusted.MAX_TOKENIZER_BYTES + 1:,} bytes, more than the",
    ),
    "a GGUF": (
        h.gguf,
        "holds a GGUF (model-q8_0.gguf), which doel-export does not read",
    ),
}


def test_the_folder_the_hostile_ones_start_from_is_taken(tmp_path):
    ckpt = inspect_checkpoint(h.checkpoint(tmp_path / "ckpt"))
    assert (ckpt.vocab_size, ckpt.kv_heads, ckpt.head_dim) == (64, 2, 4)
    assert read_bundle(h.bundle(tmp_path / "bundle")).layers == 2
    tokenizer = h.tokenizer_normalizer(tmp_path / "tok", _sequence([h.replace(" ", "▁")] * 2))
    assert inspect_checkpoint(tokenizer).tokenizer_vocab_size == 3  # two plain replacements


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_doel_export_refuses_a_hostile_folder_in_one_line_naming_the_field(tmp_path, case):
    make, said = CHECKPOINTS[case]
    with pytest.raises(ExportError) as e:
        inspect_checkpoint(make(tmp_path / "hostile"))
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


# (hostile bundle, what the one line says)
BUNDLES = {
    "a model named ../": (
        lambda p: h.bundle(p, model="../model.onnx"),
        "manifest.json model is '../model.onnx', not the name of a file in the folder",
    ),
    "a model named by an absolute path": (
        lambda p: h.bundle(p, model="/etc/passwd"),
        "manifest.json model is '/etc/passwd', not the name of a file in the folder",
    ),
    "a files table naming ../": (
        lambda p: h.bundle(p, files={"../../.ssh/id_rsa": {"bytes": 1, "sha256": "0"}}),
        "manifest.json files is '../../.ssh/id_rsa', not the name of a file in the folder",
    ),
    "a tokenizer.json linked out": (
        lambda p: h.link_out(p, "tokenizer.json"),
        "the bundle's tokenizer.json: ",
    ),
    "a model.onnx linked out": (
        lambda p: h.link_out(p, "model.onnx"),
        "the bundle's model.onnx: ",
    ),
    "a context of 2^40": (
        lambda p: h.bundle(p, context_length=2**40),
        "manifest.json context_length is 1099511627776, outside 1..16,777,216",
    ),
    "a vocabulary of 2^40": (
        lambda p: h.bundle(p, vocab_size=2**40),
        "manifest.json vocab_size is 1099511627776, outside",
    ),
    "a billion layers": (
        lambda p: h.bundle(p, **h.kv_cache(layers=10**9)),
        "manifest.json kv_cache.layers is 1000000000, outside 1..1,024",
    ),
    "a cache larger than the machine": (
        lambda p: h.bundle(
            p, context_length=2**24, **h.kv_cache(layers=1024, kv_heads=1024, head_dim=4096)
        ),
        "manifest.json kv_cache and context_length ask for a KV cache of 536,870,912.0 GiB a slot",
    ),
    "a manifest nested deep": (
        lambda p: h.bundle(p, "[" * 100_000 + "]" * 100_000),
        "manifest.json is JSON nested too deep to read",
    ),
    "an enormous manifest.json": (
        lambda p: h.sparse(h.bundle(p) / "manifest.json", untrusted.MAX_RECORD_BYTES + 1).parent,
        f"manifest.json is {untrusted.MAX_RECORD_BYTES + 1:,} bytes, more than the",
    ),
    "millions of merges": (
        lambda p: h.bundle(p, tokenizer=h.merges(untrusted.MAX_VOCAB + 1)),
        f"tokenizer.json model.merges has {untrusted.MAX_VOCAB + 1:,} entries",
    ),
    "a GGUF": (h.gguf, "holds a GGUF for llama.cpp (model-q8_0.gguf)"),
}


@pytest.mark.parametrize("case", BUNDLES)
def test_doel_serve_refuses_a_hostile_bundle_in_one_line_naming_the_field(tmp_path, case):
    make, said = BUNDLES[case]
    with pytest.raises(BundleError) as e:
        read_bundle(make(tmp_path / "hostile"))
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_link_out_of_the_bundle_names_where_it_leads_but_the_hub_cache_is_taken(tmp_path):
    with pytest.raises(BundleError) as e:
        read_bundle(h.link_out(tmp_path / "linked", "tokenizer.json"))
    assert str(e.value).startswith(
        f"the bundle's tokenizer.json: {tmp_path / 'linked' / 'tokenizer.json'} is a link to "
        f"{(tmp_path / 'outside-tokenizer.json').resolve()}, outside the folder"
    )
    # snapshots/REV/NAME -> ../../blobs/HASH, as huggingface_hub downloads: the cache's own links
    snapshot = h.hugging_face_cache(tmp_path / "models--someone--bundle")
    assert (snapshot / "tokenizer.json").is_symlink()
    assert read_bundle(snapshot).tokenizer == snapshot / "tokenizer.json"


def test_the_command_lines_print_one_line_and_write_nothing(tmp_path, capsys):
    from doel.export.cli import main as export_main
    from doel.serve.cli import main as serve_main

    out = tmp_path / "out"
    for case in ("a billion layers", "millions of merges", "a GGUF"):
        folder = CHECKPOINTS[case][0](tmp_path / case)
        with pytest.raises(SystemExit) as e:
            export_main([str(folder), "--out", str(out)])
        assert str(e.value.code).startswith("error: ") and CHECKPOINTS[case][1] in e.value.code
        assert "\n" not in e.value.code and not out.exists()
    for case in ("a model named ../", "a cache larger than the machine", "a GGUF"):
        folder = BUNDLES[case][0](tmp_path / f"bundle {case}")
        with pytest.raises(SystemExit) as e:
            serve_main([str(folder)])
        assert str(e.value.code).startswith("error: ") and BUNDLES[case][1] in e.value.code
        assert "\n" not in e.value.code
    assert "Traceback" not in capsys.readouterr().err


# Runs its arguments as a child and prints that child's peak RSS. A child forked from pytest
# itself would report pytest's resident memory at the fork (hundreds of MB with torch loaded) as
# its own peak; one forked from this small process reports what the command itself took.
MEASURE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(done.returncode)\n"
)


def _peak_rss_mb(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    """Run `python args` to its end: its peak resident memory in MB, and what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return int(done.stdout.split()[-1]) * scale / 2**20, done


@pytest.mark.slow  # spawns doel-export and doel-serve
def test_a_refusal_stays_under_200_mb_of_memory(tmp_path):
    runs = {
        "export, a vocabulary of 2^40": ["-m", "doel.export", CHECKPOINTS["a vocabulary of 2^40"]],
        "export, millions of merges": ["-m", "doel.export", CHECKPOINTS["millions of merges"]],
        "export, a header longer than the file": [
            "-m", "doel.export", CHECKPOINTS["a header longer than the file"]],
        "serve, a cache larger than the machine": [
            "-m", "doel.serve", BUNDLES["a cache larger than the machine"]],
        "serve, millions of merges": ["-m", "doel.serve", BUNDLES["millions of merges"]],
    }  # fmt: skip
    for name, (flag, module, (make, said)) in runs.items():
        folder = make(tmp_path / name)
        extra = ["--out", str(tmp_path / "out")] if module == "doel.export" else []
        mb, done = _peak_rss_mb([flag, module, str(folder), *extra])
        stderr = done.stderr
        print(f"{name}: peak RSS {mb:.0f} MB")
        assert done.returncode == 1 and "Traceback" not in stderr, stderr
        assert stderr.startswith("error: ") and said in stderr and stderr.count("\n") == 1, stderr
        assert mb < MAX_RSS_MB, f"{name}: {mb:.0f} MB"


def test_the_docs_quote_every_bound_as_the_code_defines_it():
    from doel.export.claims import MAX_CLAIM_RATIO

    text = (ROOT / "docs" / "export.md").read_text(encoding="utf-8")
    section = text[text.index("## What an untrusted folder is checked for") :]
    section = section[: section.index("\n## ")]
    bounds = {n: getattr(untrusted, n) for n in dir(untrusted) if n.startswith("MAX_")}
    for name, value in {**bounds, "MAX_CLAIM_RATIO": MAX_CLAIM_RATIO}.items():
        assert f"`{name}` = {value:,}" in section, name
