"""Issue 57's gate|up lever: the fusion of each layer's gate and up MatMulNBits into one of 2N
rows and a Split gives the same outputs bit for bit, refuses pairs it cannot join, and its
probe reports what it timed."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest


def _probe():
    return importlib.import_module("benchmarks.probes.probe_gate_up")


K, N, BLOCK = 64, 96, 32


def _mlp(bits=(4, 4), zero_points=False, bias=False, layers=2, seed=0):
    """`layers` SwiGLU MLPs as the builder writes them: gate and up MatMulNBits of one input,
    Sigmoid, Mul, Mul, then a down MatMulNBits back to K, each layer feeding the next."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    blocks = K // BLOCK
    nodes, inits = [], []

    def matmul(name, x, k, n, b, out):
        nb = k // BLOCK
        ins = [x, f"{name}.weight", f"{name}.scales"]
        inits.append(
            numpy_helper.from_array(rng.integers(0, 256, (n, nb, BLOCK * b // 8), np.uint8), ins[1])
        )
        scales = (rng.random(n * nb, dtype=np.float32) * 0.02).astype(np.float32)
        inits.append(numpy_helper.from_array(scales, ins[2]))
        if zero_points or bias:
            ins.append(f"{name}.zp" if zero_points else "")
        if zero_points:
            per_row = -(-nb * b // 8)
            zp = rng.integers(0, 256, n * per_row, np.uint8)
            inits.append(numpy_helper.from_array(zp, ins[3]))
        if bias:
            ins += ["", f"{name}.bias"]
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), ins[5]))
        attrs = {"K": k, "N": n, "bits": b, "block_size": BLOCK, "accuracy_level": 4}
        nodes.append(
            helper.make_node(
                "MatMulNBits", ins, [out], name=f"/{name}/MatMul", domain="com.microsoft", **attrs
            )
        )

    x = "x"
    for i in range(layers):
        p = f"model/layers.{i}/mlp"
        matmul(f"{p}/gate_proj", x, K, N, bits[0], f"{p}/gate")
        matmul(f"{p}/up_proj", x, K, N, bits[1], f"{p}/up")
        nodes.append(helper.make_node("Sigmoid", [f"{p}/gate"], [f"{p}/sig"]))
        nodes.append(helper.make_node("Mul", [f"{p}/gate", f"{p}/sig"], [f"{p}/silu"]))
        nodes.append(helper.make_node("Mul", [f"{p}/silu", f"{p}/up"], [f"{p}/h"]))
        matmul(f"{p}/down_proj", f"{p}/h", N, K, bits[0], f"{p}/out")
        x = f"{p}/out"
    assert blocks == 2
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", K])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, "s", K])],
        inits,
    )
    opset = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return onnx.helper.make_model(graph, opset_imports=opset)


def _run(m, x):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    s = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


@pytest.mark.parametrize(
    "bits,zero_points,bias",
    [((4, 4), False, False), ((8, 8), False, False), ((4, 4), True, False), ((4, 4), False, True)],
)
def test_the_fused_mlp_gives_the_original_outputs_bit_for_bit(bits, zero_points, bias):
    import copy

    probe = _probe()
    m = _mlp(bits, zero_points, bias)
    fused = copy.deepcopy(m)
    assert probe.fuse_gate_up(fused) == 2
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MatMulNBits") == 4 and ops.count("Split") == 2  # was 6 and 0
    joined = [n for n in fused.graph.node if "gate_up_proj" in n.name]
    assert {a.i for n in joined for a in n.attribute if a.name == "N"} == {2 * N}
    names = {t.name for t in fused.graph.initializer}
    assert not any("/gate_proj" in n or "/up_proj" in n for n in names)  # the halves are gone
    x = np.random.default_rng(3).standard_normal((1, 1, K)).astype(np.float32)
    want = _run(m, x)
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(_run(fused, x), want)
    # and for many rows (a prefill)
    xs = np.random.default_rng(4).standard_normal((1, 5, K)).astype(np.float32)
    np.testing.assert_array_equal(_run(fused, xs), _run(m, xs))


def test_pairs_it_cannot_join_are_left_alone():
    from doel.export.gate_up import pairs

    probe = _probe()
    m = _mlp(bits=(4, 8))  # gate 4-bit, up 8-bit: one B cannot hold both
    before = [n.op_type for n in m.graph.node]
    assert pairs(m.graph) == [] and probe.fuse_gate_up(m) == 0
    assert [n.op_type for n in m.graph.node] == before


def _result():
    b = {
        "format": {"bits": 4, "block_size": 64, "matrices_by_bits": {"4": 120, "8": 31}},
        "fusion": {"layers": 30, "nodes_before": 343, "nodes_after": 343},
        "optimized": {
            "original": {"nodes": 311, "ops": {"MatMulNBits": 151, "QuickGelu": 30}},
            "fused": {"nodes": 311, "ops": {"MatMulNBits": 121, "Split": 30}},
        },
        "logits": {"prompt_max_abs_diff": 0.0, "greedy_max_abs_diff": 0.0, "bit_identical": True}
        | {"greedy_ids_equal": True, "greedy_ids": [1, 2]},
        "decode_ms": {
            "128": {"original": 7.0, "fused": 6.5},
            "1536": {"original": 9.0, "fused": 9.2},
        },
        "prefill_ms": {"original": 100.0, "fused": 90.0},
        "foreign_cpu_s": 1.5,
    }
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536}
    cfg |= {"num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}
    return {
        "model": "smollm2-135m",
        "weights": "w",
        "date": "2026-12-06",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "X", "class": "amd-avx512-vnni", "isa": {"avx2": True}},
        "load_start": 0.5,
        "machine_load": "load average 0.6 at the end (2 cores)",
        "threads": 2,
        "steps": 48,
        "rounds": 7,
        "prefill": 128,
        "contexts": [128, 1536],
        "swiglu_cpu_kernel": False,
        "config": cfg,
        "bundles": {"int4": b},
    }


def test_the_report_reads_the_ratio_and_calls_a_loss_at_one_length_not_faster():
    probe = _probe()
    r = json.loads(json.dumps(_result()))  # as read back from the JSON
    text = probe.markdown(r)
    assert (
        "| int4 | block 64; 120× 4-bit, 31× 8-bit | decode after 128 | 7.000 | 6.500 | 0.929 |"
        in text
    )
    assert "| prefill 128 | 100.000 | 90.000 | 0.900 |" in text
    assert "| int4 | 30 | 343 / 343 | 311 / 311 | 151 / 121 | 0 / 30 |" in text
    assert "int4 fused decode not faster" in text  # slower after 1,536
    r["bundles"]["int4"]["decode_ms"]["1536"]["fused"] = 8.0
    assert "int4 fused decode faster" in probe.markdown(r)


@pytest.mark.slow  # exports the tiny model at int4
def test_the_fused_bundle_serves_the_same_logits_and_is_timed(tiny_bundle, tmp_path, monkeypatch):
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.gate_up import ENV

    probe = _probe()
    monkeypatch.setenv(ENV, "0")  # the builder's two matrices, as before the export fused them
    folder = tmp_path / "int4"
    opts = ExportOptions(quant="int4", eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", folder, opts)
    cfg = json.loads((folder / "config.json").read_text())
    info = probe.fused_bundle(folder, tmp_path / "fused")
    assert info["layers"] == cfg["num_hidden_layers"]
    ops = probe.optimized_ops(tmp_path / "fused" / "model.onnx")["ops"]
    assert ops.get("Split") == cfg["num_hidden_layers"]
    es = probe.engines(folder, tmp_path / "fused", threads=1)
    c = probe.compare(es, cfg["vocab_size"], prompt=12, greedy=4)
    assert c["prompt_max_abs_diff"] <= 1e-5 and c["greedy_ids_equal"]
    t = probe.timings(es, contexts=(16,), steps=2, rounds=1, prefill=8)
    assert t["decode_ms"][16]["fused"] > 0 and t["prefill_ms"]["original"] > 0
