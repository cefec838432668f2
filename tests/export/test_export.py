"""Export: bundles from a tiny trained checkpoint through both engines, checked here against
doel's own PyTorch model (a second reference, independent of the transformers model the export
checks itself against), plus every refusal of bad input and the all-or-nothing write."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_genai")

from doel.contracts.manifest import VERSION, read_manifest  # noqa: E402
from doel.contracts.quant import QUANTS, names  # noqa: E402
from doel.export.bundle import ExportOptions, export_checkpoint, fit_block  # noqa: E402
from doel.export.cli import main  # noqa: E402
from doel.export.common import ExportError, sha256_file  # noqa: E402
from doel.export.runner import OnnxLM  # noqa: E402
from doel.train.hf import load_model, save_model  # noqa: E402
from doel.train.model import Llama, ModelConfig  # noqa: E402

TINY = ModelConfig(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def _quiet(**kw) -> ExportOptions:
    return ExportOptions(log=lambda _msg: None, eval_tokens=1024, **kw)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _assert_modes(bundle: Path, mask: int) -> None:
    """The bundle folder and each file in it have the modes mkdir and open give under `mask`."""
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o777 & ~mask
    for p in bundle.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask, p.name


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory, tokenizer_path, tok, sample_paths) -> Path:
    """The tiny model after 250 Adam steps on the sample, so that quantization costs loss."""
    torch.manual_seed(0)
    ids = [i for p in sample_paths for i in tok.encode(Path(p).read_text(encoding="utf-8")).ids]
    data = torch.tensor(ids)
    model = Llama(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(250):
        starts = torch.randint(0, len(data) - 65, (8,))
        batch = torch.stack([data[s : s + 65] for s in starts])
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 6.0  # ln 2048 = 7.6: it learned something
    return save_model(model, tmp_path_factory.mktemp("ckpt") / "final", tokenizer=tokenizer_path)


@pytest.fixture(scope="session")
def fp32_bundle(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "fp32"
    with _umask(0o022):
        export_checkpoint(ckpt, out, _quiet(quant="fp32"))
    return out


def _doel_logits(ckpt: Path, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return load_model(ckpt)(torch.from_numpy(ids)).numpy()


def _lm(bundle: Path, name: str = "model.onnx") -> OnnxLM:
    return OnnxLM(bundle / name, TINY.num_key_value_heads, TINY.head_dim)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _nbits_attrs(model: Path) -> set[tuple[int, int]]:
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    found = set()
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            found.add((attrs["bits"], attrs["block_size"]))
    return found


def _strings(obj) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in [k, *_strings(v)]]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def test_fp32_bundle_matches_pytorch_and_describes_itself(fp32_bundle, ckpt, tok):
    m = json.loads((fp32_bundle / "manifest.json").read_text())
    assert m["engine"] == "genai" and m["quantization"]["scheme"] == "fp32"
    # Every file is listed with its true hash; the tokenizer is the checkpoint's, unchanged.
    listed = set(m["files"])
    assert listed == {p.name for p in fp32_bundle.iterdir()} - {"manifest.json"}
    for name, entry in m["files"].items():
        assert entry["sha256"] == sha256_file(fp32_bundle / name)
    assert sha256_file(fp32_bundle / "tokenizer.json") == sha256_file(ckpt / "tokenizer.json")
    _assert_modes(fp32_bundle, 0o022)  # written under umask 022: another account can serve it
    # The source by name and hashes, never by where it lay on the exporting machine.
    assert m["source"]["config_sha256"] == sha256_file(ckpt / "config.json")
    weights = ckpt / "model.safetensors"
    assert m["source"]["folder"] == ckpt.name == "final"
    assert m["source"]["weights"] == {
        "model.safetensors": {"bytes": weights.stat().st_size, "sha256": sha256_file(weights)}
    }
    assert str(ckpt.parent) not in (fp32_bundle / "manifest.json").read_text()
    assert not [s for s in _strings(m) if os.path.isabs(s)]
    assert m["vocab_size"] == TINY.vocab_size and m["context_length"] == 256
    assert m["special_tokens"]["bos"] == {"id": 0, "token": "<|bos|>"}
    lm = _lm(fp32_bundle)
    assert [i["name"] for i in m["inputs"]] == lm.input_names
    assert m["kv_cache"]["layers"] == TINY.num_hidden_layers
    # Independent of the export's own check: doel's model, a prompt the export never saw.
    ids = np.array([tok.encode("নদীর ধারে একটি ছোট গ্রাম ছিল, and a boat.").ids])
    want = _doel_logits(ckpt, ids)
    assert _rel(lm.logits(ids), want) < 1e-4
    assert _rel(lm.logits_with_cache(ids, 3), want) < 1e-4
    p = m["parity"]
    assert (
        p["logits_vs_torch"]["max_rel_err"] < 1e-4 and p["kv_cache_vs_full"]["max_rel_err"] < 1e-4
    )
    assert abs(p["loss"]["increase_nats_per_token"]) < 1e-4 and p["loss"]["tokens"] >= 1000
    # The manifest is the typed record serve reads: its kind, format and version.
    record = read_manifest(fp32_bundle)
    assert (record.kind, record.quant, record.version) == ("onnx", "fp32", VERSION)
    assert record.kv_cache.layers == m["kv_cache"]["layers"] and record.model == "model.onnx"


@pytest.mark.parametrize("name", names("onnx"))
def test_every_onnx_row_of_the_table_builds_as_the_row_says(ckpt, tmp_path, name):
    """Bits, the fitted block, the head's bits and the loss bound of each bundle are its row's
    in doel.contracts.quant."""
    from doel.export.parity import LOGITS_BOUND

    row, out = QUANTS[name], tmp_path / name
    m = export_checkpoint(ckpt, out, _quiet(quant=name))
    assert read_manifest(out).quant == name
    q, parity = m["quantization"], m["parity"]
    if not row.quantized:
        assert q["bits"] == 32 and not _nbits_attrs(out / "model.onnx")
        assert parity["logits_vs_torch"]["bound"] == LOGITS_BOUND
        return
    block = fit_block(name, (TINY.hidden_size, TINY.intermediate_size))
    assert (q["bits"], q["block_size"], q["lm_head"]) == (
        row.bits, block, f"int{row.head_bits} MatMulNBits"
    )  # fmt: skip
    assert _nbits_attrs(out / "model.onnx") == {(row.bits, block), (row.head_bits, block)}
    assert parity["loss"]["bound_nats_per_token"] == row.loss_bound
    assert q["promoted"]["bits"] == row.promoted_bits and bool(q["promoted"]["matrices"]) == bool(
        row.promoted_bits
    )


def _finer(model: Path, bits: int) -> set[tuple[int, str]]:
    """(layer, matrix) of the body's MatMulNBits written with more than `bits` bits."""
    import onnx

    found = set()
    for node in onnx.load(str(model), load_external_data=False).graph.node:
        hit = re.search(r"layers\.(\d+)/\w+/(\w+)/MatMul", node.name)
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMulNBits" and hit and attrs["bits"] > bits:
            found.add((int(hit.group(1)), hit.group(2)))
    return found


def test_int4_keeps_llama_cpps_mixed_matrices_finer_unless_told_not_to(ckpt, tmp_path):
    """The first and last eighth of the layers and every third between keep QKV and down at 8
    bits (llama.cpp's placement, the builder's `mixed_layers`); --promoted-bits 0: none."""
    n = TINY.num_hidden_layers
    layers = [i for i in range(n) if i < n / 8 or i >= 7 * n / 8 or (i - round(n / 8)) % 3 == 2]
    m = export_checkpoint(ckpt, tmp_path / "mixed", _quiet(quant="int4"))
    want = {(i, part) for i in layers for part in ("qkv_proj", "down_proj")}
    assert _finer(tmp_path / "mixed" / "model.onnx", 4) == want and layers
    assert m["quantization"]["promoted"] == {"bits": 8, "matrices": len(want), "of": 5 * n}
    m = export_checkpoint(ckpt, tmp_path / "uniform", _quiet(quant="int4", promoted_bits=0))
    assert not _finer(tmp_path / "uniform" / "model.onnx", 4)
    assert m["quantization"]["promoted"] == {"bits": None, "matrices": 0, "of": 5 * n}
    with pytest.raises(ExportError, match="--promoted-bits must be 0 or 4 or 8"):
        _quiet(quant="int4", promoted_bits=2)


def test_greedy_decoding_equals_pytorch_with_and_without_a_shared_kv_buffer(fp32_bundle, ckpt, tok):
    ids = tok.encode("আমাদের গ্রামের নাম").ids
    with torch.no_grad():
        want = load_model(ckpt).generate(torch.tensor([ids]), 24)[0, len(ids) :].tolist()
    lm = _lm(fp32_bundle)
    assert lm.greedy(ids, 24)[0] == want
    assert lm.greedy_shared(ids, 24)[0] == want


def test_the_head_can_compute_the_last_positions_only(fp32_bundle):
    """logits_to_keep (an input with a default of 0, all positions): a server asks for the
    last position only and gets the full output's last rows."""
    m = json.loads((fp32_bundle / "manifest.json").read_text())
    assert [i["name"] for i in m["optional_inputs"]] == ["logits_to_keep"]
    lm = _lm(fp32_bundle)
    ids = np.arange(5, 25)[None]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), **lm.empty_past(1)}
    full = lm.session.run(["logits"], feeds)[0]
    assert full.shape == (1, 20, TINY.vocab_size)
    for k in (1, 3):
        got = lm.session.run(["logits"], feeds | {"logits_to_keep": np.array([k])})[0]
        assert got.shape == (1, k, TINY.vocab_size)
        assert np.abs(got - full[:, -k:]).max() <= 1e-5 * np.abs(full).max()


def test_batch_axis_is_dynamic(fp32_bundle, ckpt):
    ids = np.random.default_rng(1).integers(3, TINY.vocab_size, size=(2, 20))
    both = _lm(fp32_bundle).logits(ids)
    assert _rel(both, _doel_logits(ckpt, ids)) < 1e-4
    assert _rel(both[1:], _lm(fp32_bundle).logits(ids[1:])) < 1e-5


def test_int4_mobile_bundle_costs_little_loss_and_the_ort_model_agrees(ckpt, fp32_bundle, tmp_path):
    out = tmp_path / "int4"
    m = export_checkpoint(ckpt, out, _quiet(quant="int4", mobile=True, kv_cache="fp16"))
    # The head at 8 bits; the default block fitted to the tiny model's 64-wide rows.
    assert _nbits_attrs(out / "model.onnx") == {(4, 64), (8, 64)}
    assert m["quantization"]["lm_head"] == "int8 MatMulNBits"
    loss = m["parity"]["loss"]
    # Quantization costs loss on a trained model, but little: the bound is 0.10 nats/token.
    assert 0 < loss["increase_nats_per_token"] < 0.10
    assert loss["increase_bits_per_char"] == pytest.approx(
        loss["increase_nats_per_token"] * loss["tokens"] / loss["chars"] / np.log(2)
    )
    assert {f["text"] for f in loss["files"]} == {"bn.txt", "en.txt"}
    ids = np.arange(5, 45)[None]
    assert np.array_equal(_lm(out, "model.ort").logits(ids), _lm(out).logits(ids))
    last = {"input_ids": ids, "attention_mask": np.ones_like(ids), "logits_to_keep": np.array([1])}
    last |= _lm(out).empty_past(1)
    ort_last = _lm(out, "model.ort").session.run(["logits"], last)[0]
    # One row through the head instead of 40: the kernel may sum in another order.
    assert _rel(ort_last, _lm(out).logits(ids)[:, -1:]) < 1e-5
    assert m["parity"]["ort_format_vs_onnx"]["max_rel_err"] <= 1e-5
    # The reduced-size build's config lists every operator model.ort runs, at its opset, and
    # nothing else; the ONNX operators carry the types their kernels need (type reduction).
    config = m["mobile_ops_config"]
    assert config == "required_operators_and_types.config" and config in m["files"]
    text = (out / config).read_text(encoding="utf-8")
    assert _config_ops(text) == _ort_ops(out / "model.ort")
    assert ("com.microsoft", 1, "MatMulNBits") in _config_ops(text)
    assert 'Cast{"inputs": {"0": [' in text and str(tmp_path) not in text
    size = sum(f["bytes"] for n, f in m["files"].items() if n.startswith("model.onnx"))
    fp32 = sum(p.stat().st_size for p in fp32_bundle.glob("model.onnx*"))
    assert size < fp32  # the fp32 embedding table is most of a model this small
    # The table is 8-bit, read by GatherBlockQuantized; no fp32 copy of it is left in the files.
    assert m["quantization"]["embedding"].startswith("int8 GatherBlockQuantized")
    ops = {n.op_type for n in _graph(out / "model.onnx").node}
    assert "GatherBlockQuantized" in ops
    tables = [t for t in _graph(out / "model.onnx").initializer if "embed_tokens" in t.name]
    assert sorted(t.data_type for t in tables) == [1, 2]  # uint8 data, fp32 scales
    # All the weights together weigh less than the fp32 table alone would.
    assert (out / "model.onnx.data").stat().st_size < TINY.vocab_size * TINY.hidden_size * 4

    # The cache is fp16 as asked (fp32 bundles keep fp32): prefill + steps, shared buffer or not,
    # decode as the full forward does, and the ORT-format model takes the same cache.
    assert m["kv_cache"]["dtype"] == "float16" and _lm(out).kv_dtype == np.float16
    types = {i.name: i.type for i in _lm(out, "model.ort").session.get_inputs()}
    assert types["past_key_values.0.key"] == "tensor(float16)"
    assert json.loads((fp32_bundle / "manifest.json").read_text())["kv_cache"]["dtype"] == "float32"
    prompt = [0, 398, 841, 405, 679]
    greedy = _lm(out).greedy(prompt, 12)[0]
    assert _lm(out).greedy_shared(prompt, 12)[0] == greedy
    full = _lm(out).logits(np.array([prompt + greedy[:-1]]))[0, len(prompt) - 1 :]
    assert full.argmax(-1).tolist() == greedy


def _config_ops(text: str) -> set[tuple[str, int, str]]:
    """(domain, opset, operator) of each entry of a reduced-build config; its lines read
    `domain;opset;Op1,Op2{"inputs": {...}},...` (types in braces where reduced)."""
    ops = set()
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            domain, opset, names = line.split(";", 2)
            while "{" in names:  # drop the type constraints, innermost braces first
                names = re.sub(r"\{[^{}]*\}", "", names)
            ops |= {(domain, int(opset), name) for name in names.split(",")}
    return ops


def _ort_ops(model: Path) -> set[tuple[str, int, str]]:
    """(domain, opset, operator) of each node of an ORT-format model, read from its flatbuffer."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs

    g = fbs.InferenceSession.InferenceSession.GetRootAs(model.read_bytes()).Model().Graph()
    nodes = [g.Nodes(i) for i in range(g.NodesLength())]
    return {
        (n.Domain().decode() or "ai.onnx", n.SinceVersion(), n.OpType().decode()) for n in nodes
    }


def _graph(model: Path):
    import onnx

    return onnx.load(str(model), load_external_data=False).graph


def test_the_8_bit_embedding_gathers_exactly_its_dequantized_rows(tmp_path):
    """GatherBlockQuantized returns (data - 128) * scale of the rows asked for, and each value
    is within half a step of the fp32 table (symmetric: a table and its negation round alike)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from doel.export.embedding import dequantize_rows, quantize_rows

    rng = np.random.default_rng(0)
    table = rng.normal(0, 0.02, (300, 64)).astype(np.float32)
    table[5, :32] = 0  # an all-zero block
    data, scales = quantize_rows(table, 32)
    assert data.dtype == np.uint8 and scales.shape == (300, 2)
    deq = dequantize_rows(data, scales)
    assert np.all(np.abs(deq - table) <= np.repeat(scales, 32, axis=1) * 0.5 + 1e-9)
    assert np.array_equal(dequantize_rows(*quantize_rows(-table, 32)), -deq)
    assert not deq[5, :32].any()
    node = helper.make_node(
        "GatherBlockQuantized", ["d", "ids", "s"], ["y"], domain="com.microsoft",
        bits=8, block_size=32, gather_axis=0, quantize_axis=1,
    )  # fmt: skip
    ids_info = helper.make_tensor_value_info("ids", TensorProto.INT64, [None, None])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(data, "d"), numpy_helper.from_array(scales, "s")]
    graph = helper.make_graph([node], "g", [ids_info], [y_info], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets).SerializeToString()
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    ids = np.array([[0, 5, 299, 7], [1, 1, 2, 3]])
    assert np.array_equal(sess.run(None, {"ids": ids})[0], deq[ids])


def test_optimum_engine_fp32_and_int8_with_a_block_size(ckpt, tmp_path, tok):
    fp32 = export_checkpoint(ckpt, tmp_path / "o32", _quiet(quant="fp32", engine="optimum"))
    assert fp32["engine"] == "optimum" and fp32["kv_cache"]["position_ids_input"]
    assert [i["name"] for i in fp32["optional_inputs"]] == ["logits_to_keep"]
    ids = np.array([tok.encode("The river was wide and slow.").ids])
    want = _doel_logits(ckpt, ids)
    lm = _lm(tmp_path / "o32")
    assert _rel(lm.logits(ids), want) < 1e-4 and _rel(lm.logits_with_cache(ids, 2), want) < 1e-4
    # optimum's ORTModelForCausalLM loads this bundle too (the builder's: cross/test_reach.py).
    from optimum.onnxruntime import ORTModelForCausalLM

    ort_lm = ORTModelForCausalLM.from_pretrained(tmp_path / "o32")
    inputs = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(ids.shape, dtype=int)}
    made = ort_lm.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert made[0, ids.shape[1] :].tolist() == lm.greedy(ids[0].tolist(), 8)[0]
    m = export_checkpoint(
        ckpt, tmp_path / "o8", _quiet(quant="int8", engine="optimum", block_size=16)
    )
    assert _nbits_attrs(tmp_path / "o8" / "model.onnx") == {(8, 16)}
    assert m["quantization"]["block_size"] == 16
    assert abs(m["parity"]["loss"]["increase_nats_per_token"]) < 0.02
    # The manifest says what the graph does with the table (its own, or shared with the head).
    gbq = [n for n in _graph(tmp_path / "o8" / "model.onnx").node if n.op_type.startswith("Gather")]
    quantized = any(n.op_type == "GatherBlockQuantized" for n in gbq)
    assert m["quantization"]["embedding"].startswith("int8") == quantized


def test_an_architecture_the_builder_does_not_know_goes_through_optimum(tmp_path, tokenizer_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=2048,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=1,
    )
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    shutil.copy(tokenizer_path, tmp_path / "gpt2" / "tokenizer.json")
    m = export_checkpoint(tmp_path / "gpt2", tmp_path / "b", _quiet(quant="fp32"))
    assert m["engine"] == "optimum" and m["architecture"] == "GPT2LMHeadModel"
    assert m["parity"]["logits_vs_torch"]["max_rel_err"] < 1e-4
    assert m["parity"]["kv_cache_vs_full"]["max_rel_err"] < 1e-4


def _break(ckpt: Path, tmp: Path, how: str) -> Path:
    bad = tmp / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    if how == "pickled weights":
        (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    elif how == "big tokenizer":
        cfg["vocab_size"] = 1024
    elif how == "bert":
        cfg.update(architectures=["BertForMaskedLM"], model_type="bert")
    elif how == "no tokenizer":
        (bad / "tokenizer.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    if how == "no config":
        (bad / "config.json").unlink()
    return bad


@pytest.mark.parametrize(
    "how, message",
    [
        ("no config", "has no config.json; expected a model folder in Hugging Face layout"),
        ("pickled weights", "only pickled weights"),
        ("big tokenizer", "has 2048 tokens but the model's vocab_size is 1024"),
        ("bert", "unsupported architecture BertForMaskedLM"),
        ("no tokenizer", "pass --tokenizer PATH"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(ckpt, tmp_path, how, message):
    bad = _break(ckpt, tmp_path, how)
    with pytest.raises(ExportError, match=message):
        export_checkpoint(bad, tmp_path / "out", _quiet(quant="fp32"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def _damage(ckpt: Path, tmp: Path, how: str) -> tuple[Path, Path]:
    """A copy of the checkpoint with one file damaged as an interrupted copy or a bad disk would;
    returns (folder, the damaged file)."""
    bad = tmp / "bad"
    shutil.copytree(ckpt, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if how == "cut in the weights":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "cut in the header":
        weights.write_bytes(data[: 8 + n // 2])
    elif how == "four bytes":
        weights.write_bytes(data[:4])
    elif how == "header not JSON":
        weights.write_bytes(data[:8] + b"#" * n + data[8 + n :])
    elif how == "a tensor's size":  # same length, so only the tensor's own size can tell
        weights.write_bytes(data.replace(b'"F32"', b'"F16"', 1))
    elif how == "missing shard":
        index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
        return bad, bad
    elif how == "cut config":
        text = (bad / "config.json").read_text()
        (bad / "config.json").write_text(text[: len(text) // 2])
        return bad, bad / "config.json"
    return bad, weights


DAMAGE = {
    "cut in the weights": r"is truncated or damaged: its header describes \d+ bytes, the file has",
    "cut in the header": "is truncated or not a safetensors file",
    "four bytes": "is truncated or not a safetensors file",
    "header not JSON": "is truncated or not a safetensors file",
    "a tensor's size": r"is damaged: tensor '.+' takes \d+ bytes where its shape and dtype need",
    "missing shard": "lacks model-00002-of-00002.safetensors, named in model.safetensors.index",
    "cut config": "is not valid JSON",
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_checkpoint_is_refused_before_any_work_naming_the_file(
    ckpt, tmp_path, monkeypatch, how
):
    from doel.export import graph

    def build_graph(*_args, **_kw):
        raise AssertionError("the graph builder ran on a damaged checkpoint")

    monkeypatch.setattr(graph, "build_graph", build_graph)
    bad, damaged = _damage(ckpt, tmp_path, how)
    with pytest.raises(SystemExit) as e:
        main([str(bad), "--out", str(tmp_path / "out"), "--quant", "fp32"])
    message = str(e.value.code)
    assert message.startswith(f"error: {damaged}") and "\n" not in message
    assert re.search(DAMAGE[how], message), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_only_the_model_weights_are_checked_and_hashed(ckpt, tmp_path):
    """A training checkpoint also holds optimizer and RNG state: not the model's, not read."""
    from doel.export.checkpoint import inspect_checkpoint

    step = tmp_path / "step-000100"
    shutil.copytree(ckpt, step)
    (step / "optimizer.safetensors").write_bytes(b"cut short")
    assert inspect_checkpoint(step).weights == (step / "model.safetensors",)


def test_doel_export_on_a_truncated_checkpoint_prints_one_line(ckpt, tmp_path):
    """The reproduction: a model.safetensors cut short, as by an interrupted copy."""
    bad, weights = _damage(ckpt, tmp_path, "cut in the weights")
    cmd = [sys.executable, "-m", "doel.export", str(bad), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {weights} is truncated or damaged")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_not_a_folder_and_bad_options(tmp_path, ckpt):
    with pytest.raises(ExportError, match="is not a folder"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out", _quiet(quant="fp32"))
    with pytest.raises(ExportError, match="--block-size must be one of"):
        _quiet(quant="int4", block_size=24)
    with pytest.raises(ExportError, match="--head-bits must be 4 or 8"):
        _quiet(quant="int4", head_bits=2)
    with pytest.raises(ExportError, match="--kv-cache must be one of"):
        _quiet(quant="int4", kv_cache="fp8")
    (tmp_path / "t.csv").write_text("a,b\n")
    for text, message in (("nope.txt", "no such file"), ("t.csv", "give .txt or .jsonl")):
        with pytest.raises(ExportError, match=message):
            export_checkpoint(
                ckpt, tmp_path / "out", _quiet(quant="fp32", texts=(str(tmp_path / text),))
            )
    assert not (tmp_path / "out").exists()


def test_held_out_text_is_cut_at_the_token_budget_with_exact_characters(ckpt, tmp_path):
    from doel.export.checkpoint import inspect_checkpoint
    from doel.export.parity import eval_texts

    long = "নদীর ধারে একটি ছোট গ্রাম ছিল। " * 40
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": long}) + "\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("one line\nanother line here\n", encoding="utf-8")
    a, b = eval_texts(inspect_checkpoint(ckpt), [tmp_path / "a.jsonl", tmp_path / "b.txt"], 60)
    assert sum(len(d) - 1 for d in a["docs"]) == 30  # half the budget each, cut mid-document
    assert 0 < a["chars"] < len(long.strip())
    assert len(b["docs"]) == 2 and b["chars"] == len("one line") + len("another line here")


def _figures(kv: float, quantized_vs_torch: float) -> dict:
    return {
        "logits_vs_torch": {"max_rel_err": quantized_vs_torch},
        "kv_cache_vs_full": {"max_rel_err": kv},
        "loss": {"increase_nats_per_token": 0.0, "increase_bits_per_char": 0.0},
    }


def test_the_cache_path_may_differ_by_no_more_than_quantization_does():
    from doel.export.parity import check

    check(_figures(0.024, 0.045), "int8", None)  # measured at 0.4B: int8 kernels differ by shape
    with pytest.raises(ExportError, match=r"KV-cache path differs .* by 5\.00e-02 \(bound 4"):
        check(_figures(0.05, 0.045), "int8", None)
    with pytest.raises(ExportError, match=r"by 2\.00e-04 \(bound 1\.0e-04\)"):
        check(_figures(2e-4, 1e-6), "fp32", None)


def test_the_summary_prints_each_figure_with_its_bound_and_whether_it_holds():
    from doel.export.bundle import summary

    def manifest(scheme, logits_bound, kv, kv_bound, loss, loss_bound):
        return {
            "files": {"model.onnx": {"bytes": 3_000_000}},
            "quantization": {"scheme": scheme},
            "engine": "genai",
            "timing": {"total_s": 12.0},
            "parity": {
                "logits_vs_torch": {
                    "max_rel_err": 0.304, "top1_agreement": 0.971, "bound": logits_bound
                },
                "kv_cache_vs_full": {"max_rel_err": kv, "bound": kv_bound},
                "loss": {"increase_nats_per_token": loss, "increase_bits_per_char": loss / 3,
                         "tokens": 4096, "bound_nats_per_token": loss_bound},
                "ort_format_vs_onnx": {"max_rel_err": 0.0, "bound": 1e-5},
            },
        }  # fmt: skip

    text = summary(Path("b"), manifest("int4 weight-only, MatMulNBits", None, 3.3e-4, 0.304,
                                       0.0123, 0.1))  # fmt: skip
    assert "max rel err 3.04e-01, top-1 agreement 0.971 (quantized: no bound, see the loss)" in text
    assert "max rel err 3.30e-04 (bound 3.0e-01: ok)" in text
    assert "+0.0123 nats/token (bound 0.1: ok)" in text
    assert "ORT format vs ONNX: max rel err 0.00e+00 (bound 1e-05: ok)" in text
    # A figure past its bound (a bundle from before a tighter bound) says so.
    text = summary(Path("b"), manifest("fp32", 1e-4, 2e-4, 1e-4, 0.3, 0.1))
    assert "max rel err 3.04e-01 (bound 1e-04: over), top-1 agreement 0.971" in text
    assert "(bound 1.0e-04: over)" in text and "+0.3000 nats/token (bound 0.1: over)" in text
    assert "no bound" not in text


def test_failed_check_leaves_the_old_bundle_and_no_partial_one(ckpt, fp32_bundle, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(fp32_bundle, out)
    before = sha256_file(out / "manifest.json")
    with pytest.raises(ExportError, match=r"raises the held-out loss by 0\.0\d+ nats/token"):
        export_checkpoint(ckpt, out, _quiet(quant="int4", force=True, max_loss_increase=0.0))
    assert sha256_file(out / "manifest.json") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_cli_refuses_an_existing_bundle_and_replaces_it_with_force(ckpt, tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    with pytest.raises(SystemExit, match="exists; pass --force"):
        main([str(ckpt), "--out", str(out), "--quant", "fp32"])
    with _umask(0o027):
        main([str(ckpt), "--out", str(out), "--quant", "int8", "--force", "--eval-tokens", "512"])
    assert "max rel err" in capsys.readouterr().out
    _assert_modes(out, 0o027)
    q = json.loads((out / "manifest.json").read_text())["quantization"]
    # int8's default block, 256 weights a scale, halved to fit the tiny model's 64-wide rows.
    assert q["bits"] == 8 and q["block_size"] == 64
    assert _nbits_attrs(out / "model.onnx") == {(8, 64)}


@pytest.mark.parametrize(
    "quant, widths, block",
    [
        ("int4", (1024, 3584), 256),  # bangla-0.4b
        ("int4", (384, 1024), 128),  # small: 384 is no multiple of 256
        ("int4", (192, 512), 64),  # the demo
        ("int8", (1024, 3584), 256),
        ("int8", (576, 1536), 64),  # SmolLM2-135M: 576 = 9 × 64
        ("int8", (24, 48), 16),  # the smallest block MatMulNBits takes, whatever the width
    ],
)
def test_the_default_block_is_the_largest_that_divides_every_row(quant, widths, block):
    assert fit_block(quant, widths) == block


def test_force_replaces_only_a_bundle_never_other_files(ckpt, tmp_path, capsys):
    files = {"notes.txt": "my notes", "photos/a.jpg": "jpeg", "web/manifest.json": '{"name": "x"}'}
    for name, text in files.items():
        (tmp_path / "mine" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "mine" / name).write_text(text)
    (tmp_path / "a.txt").write_text("a file")
    # A folder of other files, one with somebody else's manifest.json, a file.
    for out in ("mine", "mine/web", "a.txt"):
        with pytest.raises(SystemExit) as e:
            main([str(ckpt), "--out", str(tmp_path / out), "--quant", "fp32", "--force"])
        message = str(e.value.code)
        assert message.startswith(f"error: {tmp_path / out} is not ") and "\n" not in message
        assert "--force replaces only a bundle: choose another --out" in message
    for name, text in files.items():
        assert (tmp_path / "mine" / name).read_text() == text
    assert (tmp_path / "a.txt").read_text() == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "mine"]  # no staging folder
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "mine").rglob("*")) == sorted(
        ["mine/notes.txt", "mine/photos", "mine/photos/a.jpg", "mine/web", "mine/web/manifest.json"]
    )


def test_cli_names_the_extra_when_a_package_is_missing(ckpt, tmp_path, monkeypatch):
    import sys

    for name in ("onnxruntime_genai", "onnxruntime_genai.models"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of them now fails
    with pytest.raises(SystemExit, match=r"pip install 'doel\[export\]'"):
        main([str(ckpt), "--out", str(tmp_path / "b"), "--quant", "fp32"])
    assert not any(tmp_path.iterdir())
