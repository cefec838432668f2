"""The profile's ceilings of 8 streams over one and its GEMM paragraph, on a model shape small
enough to count by hand."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench(name: str = "serve.bench_serve"):
    """A script of benchmarks/ as the module `benchmarks.NAME` (the package the root holds)."""
    return importlib.import_module(f"benchmarks.{name}")


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
    profile_serve = _bench("serve.profile_serve")
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
    profile_serve = _bench("serve.profile_serve")
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
    profile_serve = _bench("serve.profile_serve")
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
    profile_serve = _bench("serve.profile_serve")

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
