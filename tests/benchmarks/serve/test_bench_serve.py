"""The serving benchmark's engine runs, bandwidth bound, targets and report work on the tiny
bundle; its sweep and engine rows pool their processes; llama.cpp's padded tokenizer."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c avx2 bmi2"  # an AVX2-only AMD CPU's flags


def _cpuinfo(vendor: str, name: str, flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: {name}\nflags\t\t: {flags}\n"


# ---------------------------------------------------------------- the serving benchmark


def _bench(name: str = "serve.bench_serve"):
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
    from benchmarks.common.cpu_class import describe
    from benchmarks.common.report import publish
    from benchmarks.serve.bench_serve_report import figure, markdown

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
    from benchmarks.serve.bench_serve_report import streams_ratio

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
    publish(tmp_path, "serve", result, md, figure(result), echo=False)
    assert (tmp_path / "serve.png").stat().st_size > 10_000


def test_gguf_tokenizer_lists_every_embedding_row_and_encodes_as_before(tokenizer_path):
    from tokenizers import Tokenizer

    from benchmarks.serve.bench_serve_llama import padded_tokenizer

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
    percentile = _bench("serve.bench_serve_engines").percentile

    values = np.random.default_rng(0).random(13).tolist()
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


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
