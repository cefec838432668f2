"""The GPU benchmark script runs end to end (on the CPU here, with the tiny preset); the serving
benchmark's engine runs, bandwidth bound, targets and report work on the tiny bundle."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # spawns the benchmark script
def test_gpu_benchmark_script_reports_mfu_and_the_gate(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_gpu",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--verify",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (result,) = tmp_path.glob("gpu_tiny_cpu_*.json")
    r = json.loads(result.read_text())
    assert r["gate_ok"] and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5
    assert r["verify_ok"] and list(tmp_path.glob("verify_tiny_cpu_*/verify.md"))
    assert r["backward_over_forward"] > 0 and (tmp_path / result.name).with_suffix(".md").is_file()


# ---------------------------------------------------------------- the serving benchmark


def _bench(name: str = "bench_serve"):
    """A script of benchmarks/ as the module `benchmarks.NAME` (the package the root holds)."""
    return importlib.import_module(f"benchmarks.{name}")


QUICK = {
    "short": 8,
    "long": 40,
    "new_tokens": 6,
    "repeats": {"short": 2, "long": 1},
    "streams": [1, 2, 4],
    "sweep_prompt": 8,
    "sweep_new_tokens": 5,
    "single_stream_rounds": 2,
    "processes": 1,
}


@pytest.fixture(scope="module")
def serve_spec(tmp_path_factory, tiny_bundle):
    bundle = tiny_bundle
    cfg = json.loads((bundle.parent / "serve-ckpt" / "config.json").read_text())
    spec = tmp_path_factory.mktemp("bench-serve") / "spec.json"
    spec.write_text(json.dumps(_bench().spec_for(QUICK, cfg, 2048)))
    return bundle, cfg, spec


def test_serve_benchmark_times_our_engine_and_its_sweep_in_their_own_processes(
    serve_spec, tmp_path
):
    bench = _bench()
    bundle, cfg, spec = serve_spec
    row = bench.measured("doel", bundle, spec, tmp_path)
    for name, runs in (("short", 2), ("long", 1)):
        r = row[name]
        assert len(r["runs"]) == runs and r["ttft_s"] == min(x["ttft_s"] for x in r["runs"])
        assert r["decode_tok_s"] == max(x["decode_tok_s"] for x in r["runs"]) > 0
    assert 20 < row["peak_rss_mb"] < 2000 and row["foreign_cpu_s"] >= 0
    assert isinstance(row["busy"], bool) and row["row_wall_s"] >= row["wall_s"]
    sweep = bench.measured("doel-sweep", bundle, spec, tmp_path)["points"]
    assert [p["streams"] for p in sweep] == [1, 2, 4]
    assert [p["requests"] for p in sweep] == [2, 2, 4]  # one stream: 2 requests in turn
    for p in sweep:
        assert p["tokens"] == 5 * p["requests"]
        assert p["aggregate_tok_s"] == pytest.approx(p["tokens"] / p["wall_s"])
        assert p["decode_phase_tok_s"] > 0
        assert 0 < p["p50_latency_s"] <= p["p95_latency_s"] <= p["wall_s"]
        assert p["cached_prompt_tokens"] == 0  # fresh prompts: every one is prefilled
    prompts = json.loads(spec.read_text())["sweep_prompts"]
    assert len({tuple(x) for x in prompts}) == len(prompts) == 2 + 2 + 2 + 4

    # Bytes per token from the graph: every weight but the embedding table; this model's table
    # is tied to the head, which reads all of it, so none is left out; the checkpoint agrees.
    w = bench.onnx_bytes(bundle / "model.onnx")
    files = sum(p.stat().st_size for p in bundle.glob("model.onnx*"))
    assert w["embedding"] == 0 and 0.9 * files < w["total"] <= files
    st = bench.safetensors_bytes(bundle.parent / "serve-ckpt" / "model.safetensors")
    assert st["embedding"] == 0 and abs(st["total"] - w["total"]) < 0.05 * w["total"]
    b = bench.bound_fields(row, w, cfg, 4, 10.0, QUICK)
    kv = 2 * 2 * 2 * 16 * 4  # layers, key+value, kv heads, head dim, fp32
    want = w["total"] + kv * (40 + 3)
    assert b["kv_bytes_per_position"] == kv and b["long_bytes_per_token"] == pytest.approx(want)
    assert b["long_fraction_of_bound"] == pytest.approx(row["long"]["decode_tok_s"] * want / 10e9)


def test_serve_benchmark_targets_verdicts_and_report(serve_spec, tmp_path):
    bench = _bench()
    from benchmarks.bench_serve_report import markdown, plot
    from benchmarks.cpu_class import describe

    def row(variant, engine, decode, ttft, mem):
        run = {"ttft_s": ttft, "decode_tok_s": decode, "runs": []}
        return {
            "engine": engine,
            "variant": variant,
            "bits": 4,
            "short": run,
            "long": run,
            "peak_rss_mb": mem,
            "load_s": 1.0,
            "short_fraction_of_bound": 0.4,
            "long_fraction_of_bound": 0.3,
            "foreign_cpu_s": 0.0,
            "row_wall_s": 9.0,
            "busy": False,
        }

    rows = {
        "int4": row("int4", "doel", 60.0, 0.4, 400.0),
        "q4_0": row("q4_0", "llama.cpp", 50.0, 0.5, 380.0),
        # flash attention on: sooner to the first token, slower to decode, smaller
        "q4_0 fa": row("q4_0", "llama.cpp+fa", 45.0, 0.3, 390.0),
        "int8": row("int8", "doel", 40.0, 0.6, 500.0) | {"busy": True},
        "q8_0": {"engine": "llama.cpp", "variant": "q8_0", "missing": "not installed"},
    }
    sweep = {
        "points": [
            {
                "streams": n,
                "requests": n,
                "aggregate_tok_s": a,
                "decode_phase_tok_s": a * 1.5,
                "p50_latency_s": 1.0,
                "p95_latency_s": 2.0,
            }
            for n, a in ((1, 20.0), (8, 70.0))
        ],
        "foreign_cpu_s": 0.0,
        "row_wall_s": 5.0,
        "busy": False,
        "peak_rss_mb": 900.0,
    }
    p = bench.FULL
    got = {t["target"]: t for t in bench.targets(rows, {"int4": sweep, "int8": {}}, p)}
    # Each target against the better llama.cpp row for it.
    decode = got["decode int4 / q4_0, 128-token prompt"]
    assert decode["value"] == pytest.approx(60 / 50) and decode["met"] and decode["peer"] == "q4_0"
    ttft = got["time to first token q4_0 / int4, 1536 tokens"]
    assert ttft["value"] == pytest.approx(0.3 / 0.4) and ttft["met"] is False
    assert ttft["peer"] == "q4_0 fa"
    memory = got["peak memory int4 / q4_0"]
    assert memory["value"] == pytest.approx(400 / 380) and memory["met"] is True
    assert not [t for t in got if "8 streams" in t]  # not a target since issue 33
    from benchmarks.bench_serve_report import streams_ratio

    assert streams_ratio(sweep) == pytest.approx(3.5) and streams_ratio({}) is None
    assert got["decode int8 / q8_0, 128-token prompt"]["met"] is None  # no llama.cpp row
    rows["q4_0 fa"]["peak_rss_mb"] = 300.0
    assert bench.targets(rows, {"int4": sweep}, p)[4]["met"] is False  # 400 / 300 > 1.10
    result = {
        "date": "today",
        "machine": "m",
        "cpu": describe(_cpuinfo("AuthenticAMD", "AMD EPYC 7B13", ZEN3), "x86_64"),
        "parameters_m": 1.0,
        "tokenizer_size": 2048,
        "settings": p | {"threads": 2, "n_ctx": 2048, "preset": "tiny"},
        "model": {
            "vocab_size": 2048,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "bandwidth": {"read_gb_s": 20.0, "copy_gb_s": 15.0, "threads": 2},
        "bandwidth_end": {"read_gb_s": 19.0},
        "rows": list(rows.values()),
        "sweeps": {"int4": sweep, "int8": sweep | {"busy": True}},
        "targets": bench.targets(rows, {"int4": sweep}, p),
        "llama_cpp": {"missing": bench.INSTALL_HINT},
    }
    md = markdown(result)
    assert "| peak memory int4 / q4_0 | 1.33 | <= 1.10 | **NOT met** | q4_0 fa |" in md
    assert "not measured" in md and "missing: not installed" in md
    assert "busy machine" in md and "int8" in md.split("busy machine")[1].split("\n")[0]
    assert "sweep int8" in md.split("busy machine")[1].split("\n")[0]
    assert md.count("| 8 | 8 | 70.0 | 3.50 |") == 2  # a table for each variant
    assert "pip wheel --no-deps" in md and "-mno-amx-tile" in md
    assert "CPU: AMD EPYC 7B13, class **amd-avx2**" in md and "absent: AVX-512F" in md
    assert markdown(result | {"cpu": None}).count("CPU: not recorded") == 1  # older results
    plot(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").stat().st_size > 10_000


# ---------------------------------------------------------------- the CPU class of a result

BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c"
ZEN3 = f"{BASE} avx2 bmi2"
ALDER_LAKE = f"{BASE} avx2 avx_vnni"
ZEN5 = f"{BASE} avx2 avx512f avx512bw avx_vnni avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = f"{ZEN5} amx_bf16 amx_tile amx_int8"


def _cpuinfo(vendor: str, name: str, flags: str) -> str:
    one = f"processor\t: {{}}\nvendor_id\t: {vendor}\nmodel name\t: {name}\nflags\t\t: {flags}\n"
    return one.format(0) + "\n" + one.format(1).replace(flags, "")  # only the first is read


@pytest.mark.parametrize(
    "vendor, flags, slug",
    [
        ("AuthenticAMD", ZEN3, "amd-avx2"),
        ("GenuineIntel", ALDER_LAKE, "intel-avx2-vnni"),
        ("AuthenticAMD", ZEN5, "amd-avx512-vnni"),
        ("GenuineIntel", SAPPHIRE_RAPIDS, "intel-avx512-amx"),
        ("GenuineIntel", SAPPHIRE_RAPIDS.replace(" amx_int8", ""), "intel-avx512-vnni"),
        ("GenuineIntel", f"{BASE} avx2 avx512f", "intel-avx512"),
        ("CentaurHauls", "fpu sse sse2", "x86-sse"),
    ],
)
def test_cpu_class_names_the_best_int8_path_from_cpuinfo_flags(vendor, flags, slug):
    from benchmarks.cpu_class import describe

    cpu = describe(_cpuinfo(vendor, "Some CPU", flags), "x86_64")
    assert cpu["class"] == slug and cpu["model_name"] == "Some CPU"
    assert cpu["isa"]["AVX2"] == ("avx2" in flags) and not cpu["isa"]["ARM i8mm"]
    assert cpu["isa"]["AVX-VNNI"] == ("avx_vnni" in flags)


def test_cpu_class_reads_arm_features_and_names_the_result_file():
    bench = _bench()
    from benchmarks.cpu_class import describe, this_cpu

    graviton3 = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics asimddp sve i8mm bf16\n"
    cpu = describe(graviton3 + "CPU part\t: 0xd40\n", "aarch64")
    assert cpu["class"] == "arm-i8mm" and cpu["isa"]["ARM dotprod"] and not cpu["isa"]["AVX2"]
    assert describe("Features\t: fp asimd asimddp\n", "aarch64")["class"] == "arm-dotprod"
    assert describe("Features\t: fp asimd\n", "aarch64")["class"] == "arm"
    assert describe("", "x86_64")["model_name"] == "x86_64"  # no /proc/cpuinfo: still a name
    assert bench.result_name("bangla-0.4b", "amd-avx2") == "serve_0.4b_cpu-amd-avx2"
    assert bench.result_name("tiny", this_cpu()["class"]).startswith("serve_tiny_cpu-")


def _accuracy_levels(model: Path) -> set[int]:
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return {
        a.i
        for n in graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "accuracy_level"
    }


@pytest.mark.slow  # exports the tiny model at int4
def test_accuracy_level_probe_changes_only_the_attribute_and_times_steps(
    tiny_bundle, tmp_path, monkeypatch
):
    probe = _bench("bench_accuracy_level")

    from doel.export.bundle import ExportOptions, export_checkpoint

    opts = ExportOptions(quant="int4", eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", tmp_path / "int4", opts)
    folder = probe.variant(tmp_path / "int4", 1, tmp_path / "level1")
    assert _accuracy_levels(folder / "model.onnx") == {1}
    assert _accuracy_levels(tmp_path / "int4" / "model.onnx") == {4}  # the bundle untouched
    assert (folder / "manifest.json").read_bytes() == (
        tmp_path / "int4" / "manifest.json"
    ).read_bytes()
    monkeypatch.setattr(probe, "PROMPT", 8)
    monkeypatch.setattr(probe, "STEPS", 2)
    fp32, int8 = probe.measure(folder), probe.measure(tmp_path / "int4")
    assert fp32["step1_ms"] > 0 and fp32["step8_ms"] > 0 and fp32["logits"].shape[0] == 1
    # Same weights: only the activations' rounding differs.
    scale = np.abs(int8["logits"]).max()
    assert np.abs(fp32["logits"] - int8["logits"]).max() < 0.1 * scale
    with pytest.raises(SystemExit, match="no MatMulNBits"):
        probe.variant(tiny_bundle, 1, tmp_path / "fp32-level1")  # fp32: nothing to change


def test_gguf_tokenizer_lists_every_embedding_row_and_encodes_as_before(tokenizer_path):
    from tokenizers import Tokenizer

    from benchmarks.bench_serve_llama import padded_tokenizer

    raw = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
    padded = padded_tokenizer(raw, 3000)
    before = Tokenizer.from_file(str(tokenizer_path))
    after = Tokenizer.from_str(json.dumps(padded))
    assert before.get_vocab_size() < 3000 == after.get_vocab_size()
    assert after.id_to_token(2999) == "<|unused_2999|>"
    text = "নদীর ধারে একটি ছোট গ্রাম, and a boat."
    assert after.encode(text).ids == before.encode(text).ids
    assert padded_tokenizer(padded, 3000) == padded  # nothing left to add


def test_percentile_is_numpys_linear_one():
    percentile = _bench("bench_serve_engines").percentile

    values = np.random.default_rng(0).random(13).tolist()
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


# a model shape small enough to count its multiply-accumulates by hand
PROFILE_CFG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def test_profile_ceiling_is_the_best_any_scheduling_of_the_measured_steps_gives():
    profile_serve = _bench("profile_serve")
    cfg = PROFILE_CFG
    # q, k, v (16 dims a head: 4 + 2 + 2 heads), o, gate + up + down, per layer; then the head
    assert profile_serve.linear_macs(cfg) == 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128) + 64 * 100
    decode = {"1": {"wall_ms": 10.0, "ops_ms": {}}, "8": {"wall_ms": 20.0, "ops_ms": {}}}
    r = {
        "bundles": {"int4": {"prefill": {"wall_ms": 100.0}, "decode": decode}},
        "int8_gemm_gmac_s": {8: 100.0},
    }
    c = profile_serve.ceiling(r, cfg)["int4"]
    one, eight = 100 + 127 * 10, 8 * 100 + 127 * 20  # one stream alone; eight at best
    assert c["ratio_ceiling"] == pytest.approx(8 * one / eight)
    # the 8-row step that makes eight streams exactly 3x one
    assert 8 * one / (8 * 100 + 127 * c["step_8_needed_ms"]) == pytest.approx(3)
    assert c["matmul_8_rows_at_int8_rate_ms"] == pytest.approx(
        8 * profile_serve.linear_macs(cfg) / 100e9 * 1e3
    )
    assert "| int4 | 100 | 10.00 | 20.00 |" in "\n".join(profile_serve.ceiling_lines({"int4": c}))


def test_profile_ceiling_at_the_int8_peak_swaps_only_the_matrix_time():
    """Every matrix at the machine's fastest int8 rate, the rest of each step as profiled, and
    no step faster than reading its weights once (the 1-row step's matrix time)."""
    profile_serve = _bench("profile_serve")
    cfg = PROFILE_CFG
    macs = profile_serve.linear_macs(cfg)
    # profiled: MatMulNBits half of the 1-row run, 3/4 of the 8-row run, 4/5 of the prefill
    decode = {
        "1": {"wall_ms": 10.0, "run_ms": 12.0, "ops_ms": {"MatMulNBits": 6.0}},
        "8": {"wall_ms": 40.0, "run_ms": 44.0, "ops_ms": {"MatMulNBits": 33.0}},
    }
    prefill = {"wall_ms": 100.0, "run_ms": 110.0, "ops_ms": {"MatMulNBits": 88.0}, "tokens": 16}
    gmac_s = 2 * 8 * macs / 5.0 / 1e6  # 8 rows' matrices in 2.5 ms: under the 5 ms floor
    r = {
        "bundles": {"int4": {"prefill": prefill, "decode": decode}},
        "int8_gemm_gmac_s": {"8": gmac_s / 2, "128": gmac_s},  # as read back from JSON
    }
    c = profile_serve.ceiling(r, cfg)["int4"]
    p = 100 * (1 - 0.8) + 16 * macs / gmac_s / 1e6
    t1 = 10 * 0.5 + 5.0  # the floor: the 1-row step's matrix time
    t8 = 40 * 0.25 + 5.0  # 8 rows at the peak take 2.5 ms, under the floor
    assert c["step_8_at_peak_ms"] == pytest.approx(t8)
    assert c["step_8_rest_ms"] == pytest.approx(10.0)
    assert c["ratio_ceiling_at_peak"] == pytest.approx(8 * (p + 127 * t1) / (8 * p + 127 * t8))
    assert c["matmul_8_rows_at_int8_rate_ms"] == pytest.approx(8 * macs / (gmac_s / 2) * 1e3 / 1e9)
    lines = "\n".join(profile_serve.ceiling_lines({"int4": c}))
    assert "| 0.00 | – | 10.00 |" in lines  # no attention profiled, no bandwidth: no floor
    ceilings = f"| int4 | {c['ratio_ceiling']:.2f} | – | {c['ratio_ceiling_at_peak']:.2f} | – |"
    assert ceilings in lines


def test_profile_ceiling_with_attention_at_its_floor_keeps_the_matrices_as_measured():
    """Attention at the time each row's cache takes to read once; with the matrices at the peak
    too, what the hardware allows."""
    profile_serve = _bench("profile_serve")
    cfg = PROFILE_CFG
    macs = profile_serve.linear_macs(cfg)
    # profiled runs take 1.25x their walls: an operator's wall share is its ms / 1.25
    decode = {
        "1": {
            "wall_ms": 8.0,
            "run_ms": 10.0,
            "ops_ms": {"MatMulNBits": 5.0, "GroupQueryAttention": 1.0},
        },
        "8": {
            "wall_ms": 16.0,
            "run_ms": 20.0,
            "ops_ms": {"MatMulNBits": 10.0, "GroupQueryAttention": 5.0},
        },
    }
    prefill = {"wall_ms": 80.0, "run_ms": 100.0, "ops_ms": {"MatMulNBits": 75.0}, "tokens": 16}
    gmac_s = 8 * macs / 2.0 / 1e6  # 8 rows' matrices in 2 ms: under the 4 ms floor
    r = {
        "bundles": {"int4": {"prefill": prefill, "decode": decode}},
        "int8_gemm_gmac_s": {"128": gmac_s},
        "read_gb_s": 10.0,
        "prompt": 100,
        "steps": 19,  # the profile's steps end at 100 + 19 positions: 110 on average
    }
    c = profile_serve.ceiling(r, cfg)["int4"]
    # 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes x 110 positions
    row_bytes = 2 * 2 * 2 * 16 * 4 * 110
    assert profile_serve.kv_row_bytes(cfg, 110) == row_bytes
    floor8 = 8 * row_bytes / 10e9 * 1e3
    assert c["attention_8_rows_ms"] == pytest.approx(4.0)
    assert c["attention_8_rows_floor_ms"] == pytest.approx(floor8)
    t1 = 8.0 - 0.8 + row_bytes / 10e9 * 1e3
    t8 = 16.0 - 4.0 + floor8
    assert c["step_8_attention_floor_ms"] == pytest.approx(t8)
    ratio = profile_serve.ratio_ceiling
    assert c["ratio_ceiling_attention_floor"] == pytest.approx(ratio(80.0, t1, t8))
    assert ratio(80.0, t1, t8) == pytest.approx(8 * (80 + 127 * t1) / (8 * 80 + 127 * t8))
    # both: matrices at the peak but never under the 1-row step's 4 ms, attention at its floor
    p = 80 * (1 - 0.75) + 16 * macs / gmac_s / 1e6
    t1_hw, t8_hw = 4.0 + row_bytes / 10e9 * 1e3 + 3.2, 4.0 + floor8 + 4.0  # + the rest
    assert c["step_8_hardware_ms"] == pytest.approx(t8_hw)
    assert c["ratio_ceiling_hardware"] == pytest.approx(ratio(p, t1_hw, t8_hw))
    lines = "\n".join(profile_serve.ceiling_lines({"int4": c}))
    assert f"| {c['ratio_ceiling_hardware']:.2f} |" in lines and f"| 4.00 | {floor8:.2f} |" in lines


def test_profile_gemm_paragraph_says_what_its_rates_say():
    """The plain GEMM is called no faster at 8 rows only where it is not (AMX hosts run it at
    1.7x MatMulNBits: the sentence was fixed text)."""
    profile_serve = _bench("profile_serve")

    def result(gemm_8: float, nbits_128: float = 150.0) -> dict:
        rows = {"1": {"gmac_s": 10.0}, "8": {"gmac_s": 100.0}, "128": {"gmac_s": nbits_128}}
        return {
            "matmul_nbits": {"int4 block 256": rows},
            "int8_gemm_gmac_s": {"8": gemm_8, "128": 1000.0, "512": 1300.0},
        }

    slow = profile_serve.gemm_paragraph(result(105.0))
    assert "is no faster than the best MatMulNBits row (100)" in slow
    assert "at best 15% of it: a prefill is held by the kernel" in slow
    fast = profile_serve.gemm_paragraph(result(218.0))
    assert "no faster" not in fast and "is 2.2× the best MatMulNBits row (100)" in fast
    close = profile_serve.gemm_paragraph(result(105.0, nbits_128=900.0))
    assert "at best 90% of it. " in close and "held by the kernel" not in close


def test_sweep_processes_merge_into_each_stream_counts_best_point():
    bench = _bench()

    def run(aggs, foreign):
        pts = [{"streams": n, "aggregate_tok_s": a} for n, a in zip((1, 8), aggs)]
        return {
            "points": pts,
            "foreign_cpu_s": foreign,
            "row_wall_s": 10.0,
            "busy": False,
            "peak_rss_mb": 100.0 + foreign,
            "load_s": 1.0,
        }

    merged = bench.best_points([run((100.0, 250.0), 0.0), run((120.0, 240.0), 1.0)])
    assert [p["aggregate_tok_s"] for p in merged["points"]] == [120.0, 250.0]
    assert merged["processes"] == 2 and merged["foreign_cpu_s"] == 1.0
    assert merged["row_wall_s"] == 20.0 and merged["peak_rss_mb"] == 101.0
    assert bench.best_points([run((1.0, 2.0), 0), {"error": "exit 1"}]) == {"error": "exit 1"}


def test_engine_rows_pool_the_runs_of_their_processes():
    bench = _bench()

    def proc(ttft, tok_s, load):
        runs = [{"ttft_s": t, "decode_tok_s": d} for t, d in zip(ttft, tok_s)]
        return {
            "short": {"runs": runs, "ttft_s": min(ttft), "decode_tok_s": max(tok_s)},
            "long": {"runs": runs[:1], "ttft_s": ttft[0], "decode_tok_s": tok_s[0]},
            "load_s": load,
            "foreign_cpu_s": 0.0,
            "row_wall_s": 5.0,
            "busy": False,
            "peak_rss_mb": 300.0,
        }

    row = bench.best_row(
        [proc((0.2, 0.3), (90.0, 95.0), 1.0), proc((0.25, 0.1), (120.0, 80.0), 0.5)]
    )
    assert (row["short"]["ttft_s"], row["short"]["decode_tok_s"]) == (0.1, 120.0)
    assert len(row["short"]["runs"]) == 4 and (row["long"]["ttft_s"], row["load_s"]) == (0.2, 0.5)
    assert row["processes"] == 2 and row["row_wall_s"] == 10.0


def test_ort_options_probe_keeps_each_options_best_and_slowest_process():
    """The best figure of each kind over the processes (the least disturbed), the slowest beside
    it, and a ceiling that is the ratio of the two throughputs it prints."""
    probe = _bench("probe_ort_options")
    runs = [
        {"prefill_ms": 100.0, "step1_ms": 6.0, "step8_ms": 20.0, "foreign_cpu_s": 0.1, "wall_s": 9},
        {"prefill_ms": 90.0, "step1_ms": 7.0, "step8_ms": 18.0, "foreign_cpu_s": 0.3, "wall_s": 9},
    ]
    r = probe.best_of(runs)
    assert (r["prefill_ms"], r["step1_ms"], r["step8_ms"]) == (90.0, 6.0, 18.0)
    assert (r["prefill_ms_worst"], r["step1_ms_worst"], r["step8_ms_worst"]) == (100.0, 7.0, 20.0)
    assert r["foreign_cpu_s"] == 0.3 and r["processes"] == 2 and not r["busy"]
    one, eight = probe.stream_tok_s(90.0, 6.0, 18.0)
    assert one == pytest.approx(128 / (90 + 127 * 6) * 1e3)
    assert eight / one == pytest.approx(r["ratio_ceiling"])
    row = r | {"quant": "int4", "option": "LUT GEMM", "max_logit_diff": 0.0}
    cpu = {"model_name": "CPU", "class": "x86", "isa": {}}
    text = probe.markdown(
        {"cpu": cpu, "date": "d", "machine": "m", "onnxruntime": "1", "rows": [row]}
    )
    cells = f"| 90 | 6.00 | 18.00 | {r['ratio_ceiling']:.2f} |"
    assert f"| int4 | LUT GEMM | `mlas.use_lut_gemm=1` {cells}" in text
    assert "| 100 / 7.00 / 20.00 |" in text


def test_a_benchmark_result_is_written_whole_beside_its_markdown(tmp_path, monkeypatch):
    """Both files land in a folder made for them; a write that fails leaves the last result."""
    write_result = _bench("cpu_class").write_result
    md = write_result(tmp_path / "results", "x_cpu-amd-avx2", {"ratio": 2.5}, "# x\n")
    assert md.read_text() == "# x\n"
    assert json.loads((tmp_path / "results" / "x_cpu-amd-avx2.json").read_text()) == {"ratio": 2.5}

    def full(*_a, **_k):
        raise OSError("no space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="no space"):
        write_result(tmp_path / "results", "x_cpu-amd-avx2", {"ratio": 9.9}, "# y\n")
    assert md.read_text() == "# x\n"
    assert sorted(p.name for p in md.parent.iterdir()) == [
        "x_cpu-amd-avx2.json",
        "x_cpu-amd-avx2.md",
    ]


# ---------------------------------------------------------------- benchmarks/ as a package


def sys_path_edits(source: str) -> list[int]:
    """Lines where a source changes sys.path: a call of one of its methods (insert, append,
    extend, ...), an assignment to it or to an item of it, or `+=` on it."""

    def is_sys_path(node) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value):
                lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_sys_path_check_finds_every_kind_of_edit():
    source = (
        "import sys\n"
        "sys.path.insert(0, 'x')\n"
        "sys.path.append('x')\n"
        "sys.path[:0] = ['x']\n"
        "sys.path += ['x']\n"
        "sys.path = ['x']\n"
        "print(sys.path, 'sys.path.insert')\n"  # reading it, or naming it in text, is no edit
    )
    assert sys_path_edits(source) == [2, 3, 4, 5, 6]


def test_no_file_of_benchmarks_or_tests_edits_sys_path():
    """Benchmarks import each other as `benchmarks.NAME` and run as `python -m benchmarks.NAME`
    from the root; llama.cpp's vendored gguf package is loaded by its path
    (bench_serve_llama.gguf_package). No exception."""
    files = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").rglob("*.py")])
    assert len(files) > 40
    edits = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in files
        for line in sys_path_edits(p.read_text(encoding="utf-8"))
    ]
    assert edits == []


# Scripts of benchmarks/ that write no results file, and why.
NOT_RESULTS = {
    "__init__": "the package",
    "report": "the helpers themselves",
    "cpu_class": "prints this CPU's class",
    "bench_serve_engines": "one engine's figures, a file for bench_serve's own process",
    "bench_serve_llama": "builds llama-cpp-python and GGUF files",
    "bench_serve_report": "bench_serve's Markdown and PNG",
    "bench_load_inproc": "one in-process engine's levels, a file for bench_load's own process",
    "bench_load_report": "bench_load's targets, Markdown and PNG",
    "load_client": "bench_load's HTTP client",
    "load_model": "bench_load's model files and prompts",
    "load_servers": "builds llama-server; starts bench_load's servers",
    "bench_web_report": "bench_web's Markdown and its verdicts",
    "probe_web_table": "probe_web_matmul's Markdown",
    "web_loss": "bench_web's held-out loss of the page's graphs and kernel",
    "web_kernel_node": "runs the page's kernel in Node.js for web_loss",
}


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def test_every_benchmark_writes_its_results_through_write_result():
    """A results file written whole (cpu_class.write_result: a stopped run leaves the last
    one), never by hand: no `.write_text(json.dumps(..., indent=...))` (indented JSON is for
    reading: a report; what a process leaves for another is compact) and no
    `.write_text(markdown(...))` anywhere in benchmarks/."""
    scripts = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    assert set(NOT_RESULTS) < set(scripts), "a script named in NOT_RESULTS is gone"
    trees = {name: ast.parse(p.read_text(encoding="utf-8")) for name, p in scripts.items()}
    assert "write_result" in {_name(c.func) for c in _calls(trees["report"])}  # publish's
    missing = [
        name
        for name, tree in sorted(trees.items())
        if name not in NOT_RESULTS
        and not {"write_result", "publish"} & {_name(c.func) for c in _calls(tree)}
    ]
    assert missing == []
    by_hand = []
    for name, tree in sorted(trees.items()):
        for call in _calls(tree):
            if _name(call.func) != "write_text" or not call.args:
                continue
            arg = call.args[0]
            report_json = isinstance(arg, ast.Call) and _name(arg.func) == "dumps"
            report_json = report_json and any(k.arg == "indent" for k in arg.keywords)
            if report_json or (isinstance(arg, ast.Call) and "markdown" in _name(arg.func)):
                by_hand.append(f"{name}:{call.lineno}")
    assert by_hand == []


@pytest.mark.slow  # a fresh interpreter per script
def test_every_benchmark_runs_as_a_module_of_the_package():
    """`python -m benchmarks.NAME --help` from the root, for every script with a command line:
    what the Makefile, the docstrings and the scripts' own subprocesses run."""
    names = sorted(
        p.stem
        for p in (ROOT / "benchmarks").glob("*.py")
        if "parse_args(" in p.read_text(encoding="utf-8") and p.stem != "report"
    )
    assert {"bench_serve", "check_arm64", "bench_train", "profile_serve"} <= set(names)
    env = {**os.environ, "PYTHONPATH": ""}
    for name in names:
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}", "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        assert "usage:" in proc.stdout, name
