"""Issue 57's measurements: the streaming-read probe, the per-shape MatMulNBits chain, the
ablated decode graphs and their report."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest


def _bench(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def test_the_stream_kernel_reads_every_word_and_reports_both_probes(tmp_path):
    stream = _bench("probes.probe_stream")
    so = stream.kernel(tmp_path)
    if so is None:
        pytest.skip("no C compiler here: the probe falls back to the numpy sum")
    a = np.arange(1, 1003, dtype=np.uint64)  # not a multiple of 8: the tail loop counts too
    assert so.doel_read(a.ctypes.data, a.size) == int(a.sum())
    bw = stream.bandwidth(threads=2, mib=4, repeats=1)
    assert bw["method"].startswith("C read") and bw["read_gb_s"] > 0 and bw["numpy_sum_gb_s"] > 0


def _shape(k=64, n=96, bits=4, block=32):
    return {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": 4}


def test_a_chain_role_streams_past_the_cache_and_counts_its_bytes():
    chain = _bench("probes.probe_chain")
    s = _shape()
    # 96 rows of 2 blocks: 16 bytes of 4-bit weights and a 4-byte scale each
    assert chain.matrix_bytes(s) == 96 * 2 * (16 + 4)
    r = chain.time_role(s, min_copies=3, llc=20_000, rounds=1)
    assert r["copies"] == -(-80_000 // chain.matrix_bytes(s))  # four times the cache
    assert r["gb_s"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
    assert chain.time_role(s, min_copies=30, llc=1, rounds=1)["copies"] == 30


def test_a_chain_copy_multiplies_as_the_graph_does():
    import onnxruntime as ort

    chain = _bench("probes.probe_chain")
    s = _shape(bits=8)
    sess = ort.InferenceSession(chain.copies_graph(s, 2))
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    y0, y1 = sess.run(None, {"x": x})
    assert y0.shape == (1, 96) and not np.allclose(y0, y1)  # two matrices, two results


def _result():
    ms = {"full": 10.0, "no gqa": 8.0, "no norms": 9.5, "no activation": 9.8, "no head": 9.0}
    ms["none of the four"] = 6.5
    role = {"K": 8, "N": 8, "bits": 4, "block_size": 32, "per_token": 2, "copies": 4}
    roles = {"qkv_proj": role | {"bytes": 4e6, "ms": 1.0, "gb_s": 4.0}}
    roles["lm_head"] = role | {"per_token": 1, "bytes": 2e6, "ms": 0.5, "gb_s": 4.0}
    chain = {"llc_bytes": 2**25, "roles": roles, "step_ms": 2.5, "step_bytes": 1e7}
    chain["step_gb_s"] = 4.0
    flash = {s: {"prefill_ms": {128: 100.0}, "decode_ms": {128: 10.0}} for s in ("0", "1")}
    flash["1"]["prefill_ms"][128] = 150.0
    b = {"ms": {128: ms}, "nodes": {"full": 300, "none of the four": 200}, "chain": chain}
    b |= {"flash": flash, "foreign_cpu_s": 1.0, "flash_foreign_cpu_s": 2.0}
    bw = {"read_gb_s": 20.0, "copy_gb_s": 15.0, "numpy_sum_gb_s": 16.0, "method": "C read"}
    cfg = {"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16}
    cfg |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32}
    return {
        "model": "0.4b",
        "weights": "random",
        "date": "2026-12-06",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "X", "class": "amd-avx2", "isa": {"avx2": True}},
        "threads": 2,
        "steps": 32,
        "rounds": 3,
        "contexts": [128],
        "load_start": 1.0,
        "config": cfg,
        "bandwidth": bw | {"threads": 2, "array_mib": 512},
        "bandwidth_end": bw,
        "bundles": {"int4": b},
    }


def test_the_report_reads_each_part_as_the_full_step_minus_the_step_without_it():
    report = _bench("probes.probe_ablation_report")
    r = _result()
    c = report.costs(r["bundles"]["int4"]["ms"][128])
    assert c["gqa"] == pytest.approx(2.0) and c["head"] == pytest.approx(1.0)
    assert c["sum"] == pytest.approx(2.0 + 0.5 + 0.2 + 1.0)
    text = report.markdown(json.loads(json.dumps(r)))  # as read back from the JSON
    # the matrices without the head: 2 calls of 1 ms; the rest beyond them 6.5 - 2
    assert "| int4 | 128 | 10.00 | 2.00 | 0.50 | 0.20 | 1.00 | 3.70 | 6.50 | 2.00 | 4.50 |" in text
    assert "prefill 128 1.50×" in text and "| qkv | 8 × 8 | 4 / 32 | 2 | 4 | 4.00 |" in text


def test_the_serving_benchmark_takes_the_model():
    serve = _bench("serve.bench_serve")
    assert set(serve.MODELS) == {"0.4b", "smollm2-135m"}
    smol = serve.MODELS["smollm2-135m"]
    assert serve.result_name(smol["preset"], "amd-avx2") == "serve_smollm2-135m_cpu-amd-avx2"
    assert serve.MODELS["0.4b"]["export_flags"] == []
    load = _bench("load.bench_load")
    assert load.build_parser().parse_args([]).model == "0.4b"
    assert load.build_parser().parse_args(["--model", "smollm2-135m"]).model == "smollm2-135m"


@pytest.mark.slow  # exports the tiny model at int4
def test_each_ablated_graph_runs_and_the_full_one_steps_as_the_engine(tiny_bundle, tmp_path):
    import onnx

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.serve.core.engine import Engine, read_bundle

    probe = _bench("probes.probe_ablation")
    folder = tmp_path / "int4"
    opts = ExportOptions(quant="int4", eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", folder, opts)
    cfg = json.loads((folder / "config.json").read_text())
    kv = probe.kv_buffers(folder)
    for name, drop in probe.VARIANTS.items():
        m = probe.ablated(folder / "model.onnx", drop, cfg["hidden_size"])
        ops = {n.op_type for n in m.graph.node}
        assert ("GroupQueryAttention" in ops) == ("gqa" not in drop), name
        assert ("Sigmoid" in ops) == ("activation" not in drop), name
        onnx.save(m, str(folder / f"{name}.onnx"))
        step = probe.Stepper(folder / f"{name}.onnx", kv, cfg["vocab_size"])
        assert step.ms(5, steps=1) > 0
    # the full copy, bound as the engine binds, gives the engine's logits from the same cache
    e = Engine(read_bundle(folder), threads=1)
    want = e.decode([17], [5])[0]
    step = probe.Stepper(folder / "full.onnx", kv, cfg["vocab_size"])
    step.b.bind_cpu_input("attention_mask", np.ones((1, 5), np.int64))
    step.s.run_with_iobinding(step.b)
    np.testing.assert_allclose(step.logits.numpy()[0, 0], want, rtol=1e-4, atol=1e-4)


def test_a_role_of_mixed_formats_is_timed_once_a_format(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    chain = _bench("probes.probe_chain")
    nodes = [  # llama.cpp's mixed placement: layer 0's QKV at 8 bits, layer 1's at 4
        helper.make_node(
            "MatMulNBits",
            ["x", f"w{i}", f"s{i}"],
            [f"y{i}"],
            name=f"/layers.{i}/{role}/MatMul",
            domain="com.microsoft",
            **_shape(bits=bits),
        )  # fmt: skip
        for i, (role, bits) in enumerate(
            [("attn/qkv_proj", 8), ("attn/qkv_proj", 4), ("attn/o_proj", 4), ("attn/o_proj", 4)]
        )
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 96]) for i in range(4)]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], y)), tmp_path / "m.onnx")
    got = chain.shapes(tmp_path / "m.onnx")
    assert {k: (v["bits"], v["per_token"]) for k, v in got.items()} == {
        "qkv_proj@8/32": (8, 1),
        "qkv_proj@4/32": (4, 1),
        "o_proj": (4, 2),
    }
    lines = chain.table({"roles": {k: v | {"copies": 1, "bytes": 1, "ms": 1.0, "gb_s": 1.0}
                                   for k, v in got.items()},
                         "step_ms": 4.0, "step_bytes": 4, "step_gb_s": 1.0})  # fmt: skip
    assert sum(line.startswith("| qkv | 64 × 96 |") for line in lines) == 2
