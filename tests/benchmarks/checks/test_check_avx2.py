"""The AVX2 check: what counts as an AVX2-only CPU, its report, and (where qemu-user is
installed) that the emulated CPU really lacks AVX-512 and shows the int8 GEMM saturation the
export's choice rests on."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.checks import check_avx2


@pytest.mark.parametrize(
    ("features", "only"),
    [
        ({"AVX2": True, "FMA3": True, "AVX512F": False, "AVX512VNNI": False}, True),
        ({"AVX2": True, "FMA3": True, "AVX512F": True, "AVX512VNNI": True}, False),
        ({"AVX2": True, "AVX512F": False, "AVX512_VNNI": True}, False),
        ({"AVX2": False, "AVX512F": False}, False),
    ],
)
def test_avx2_only_means_avx2_and_no_avx512_feature(features, only):
    assert check_avx2.is_avx2_only(features) is only


def test_report_names_the_emulated_cpu_each_bundle_verdict_and_the_probe():
    row = {
        "bundle": "small-int8",
        "quant": "8-bit, kv float32",
        "side": "x86_64 EPYC-Rome (emulated)",
        "greedy_equal": False,
        "first_divergence": [1, 7],
        "top1_agreement": 0.99,
        "flip_max_gap": 1e-3,
        "max_abs_diff": 0.01,
        "max_rel_diff": 1e-3,
        "loss_increase": 1e-5,
        "seconds": 3.0,
        "failures": ["greedy ids differ from prompt 1's position 7 on"],
    }
    report = {
        "name": "t",
        "date": "2026-12-01",
        "qemu": "7.2.22",
        "cpu": "EPYC-Rome",
        "host": "AMD EPYC (amd-avx512-vnni)",
        "host_features": {"AVX512F": True},
        "guest_features": {"AVX512F": False},
        "onnxruntime": "1.32.0",
        "bounds": {},
        "prompts": 4,
        "new_tokens": 32,
        "window_positions": 512,
        "gemm_probe": {
            "native": {"u8 x s8": 0.0, "u8 x u8": 0.0},
            "guest": {"u8 x s8": 0.084, "u8 x u8": 0.0},
        },
        "rows": [row],
    }
    md = check_avx2.markdown(report)
    assert "CPU model EPYC-Rome" in md and "differ at (1, 7)" in md
    assert "greedy ids differ from prompt 1" in md
    assert "| u8 x s8 | 0.00e+00 | 8.40e-02 |" in md


@pytest.mark.slow  # runs Python under an emulator
@pytest.mark.skipif(
    not (shutil.which("qemu-x86_64-static") or shutil.which("qemu-x86_64")),
    reason="qemu-user-static is not installed",
)
def test_emulated_epyc_rome_is_avx2_only_and_saturates_u8_s8_products():
    guest = check_avx2.guest_command(check_avx2.find_qemu(), "EPYC-Rome")
    assert check_avx2.is_avx2_only(check_avx2.cpu_features(guest))
    probe = check_avx2.run_probe(guest, 300)
    assert probe["u8 x s8"] > 0.01  # 16-bit pair sums overflow on the AVX2 path
    assert probe["u8 x u8"] == 0.0
