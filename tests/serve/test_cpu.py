"""`doel-serve` says at start which MLAS path this CPU gets for MatMulNBits and which CPU class it
is (doel/contracts/cpu.py, the definition the benchmarks name their results by), and the row it
points to is in docs/kernels.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from doel.contracts.cpu import PATHS, classify, describe, this_class

ROOT = Path(__file__).resolve().parents[2]

BASE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "f16c"}
ZEN3 = BASE | {"fma", "avx2", "bmi2"}
ALDER_LAKE = ZEN3 | {"avx_vnni"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
ZEN4 = SKYLAKE_SP | {"avx512_vnni", "avx512_bf16"}
ZEN5 = ZEN4 | {"avx_vnni"}
SAPPHIRE_RAPIDS = ZEN5 | {"amx_bf16", "amx_tile", "amx_int8"}
GRAVITON3 = {"fp", "asimd", "crc32", "atomics", "asimddp", "sve", "i8mm", "bf16"}


@pytest.mark.parametrize(
    "flags, vendor, slug, path",
    [
        (ZEN3, "amd", "amd-avx2", "AVX2"),
        (ALDER_LAKE, "intel", "intel-avx2-vnni", "AVX2 + AVX-VNNI"),
        (SKYLAKE_SP, "intel", "intel-avx512", "AVX-512"),
        (ZEN4, "amd", "amd-avx512-vnni", "AVX-512 VNNI"),
        # AVX-512 wins over AVX-VNNI in platform.cpp; AMX serves MatMulInteger, not MatMulNBits
        (ZEN5, "amd", "amd-avx512-vnni", "AVX-512 VNNI"),
        (SAPPHIRE_RAPIDS, "intel", "intel-avx512-amx", "AVX-512 VNNI"),
        (SAPPHIRE_RAPIDS - {"amx_int8"}, "intel", "intel-avx512-vnni", "AVX-512 VNNI"),
        # MLAS's AVX-512 tables need BW, DQ and VL beside F (Knights Landing has F alone)
        (ZEN3 | {"avx512f", "avx512cd"}, "intel", "intel-avx512", "AVX2"),
        # and its AVX2 kernels need FMA: without it MatMulNBits has no MLAS kernel at all
        (BASE | {"avx2"}, "x86", "x86-avx2", "none (no AVX2 + FMA)"),
        (BASE, "x86", "x86-sse", "none (no AVX2 + FMA)"),
        (GRAVITON3, "arm", "arm-i8mm", "NEON + i8mm"),
        ({"fp", "asimd", "asimddp"}, "arm", "arm-dotprod", "NEON + dotprod"),
        ({"fp", "asimd"}, "arm", "arm", "NEON"),
        # no /proc/cpuinfo (macOS, Windows): no flags, and the line says the path is not known
        (set(), "x86", "x86-sse", "unknown (no /proc/cpuinfo)"),
        (set(), "arm", "arm", "unknown (no /proc/cpuinfo)"),
    ],
)
def test_each_class_gets_the_mlas_path_of_its_flags(flags, vendor, slug, path):
    found = classify(frozenset(flags), vendor)
    assert (found.slug, found.mlas.name) == (slug, path)
    line = found.line()
    assert "\n" not in line and line.startswith(f"MLAS path: {path} (int4 MatMulNBits: ")
    assert f"CPU class {slug}" in line and "docs/kernels.md" in line


def test_the_kernels_that_exist_differ_from_the_fallback_by_path():
    dequantized = {name for name, p in PATHS.items() if "dequantized" in p.int8}
    assert dequantized == {"x86", "arm"}  # 8-bit weights without an int8 kernel
    assert "dequantized" in PATHS["x86"].int4 and "fp32 activations" in PATHS["arm"].int4


def test_a_result_records_the_class_and_path_from_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
    cpu = describe(text + f"flags\t\t: {' '.join(sorted(ZEN4))}\n", "x86_64")
    assert (cpu["class"], cpu["mlas"], cpu["model_name"]) == (
        "amd-avx512-vnni",
        "AVX-512 VNNI",
        "AMD EPYC 9R14",
    )
    arm = describe("Features\t: fp asimd asimddp i8mm\nCPU part\t: 0xd40\n", "aarch64")
    assert (arm["class"], arm["mlas"]) == ("arm-i8mm", "NEON + i8mm")


def test_docs_kernels_has_a_row_for_every_path_the_line_can_name():
    text = (ROOT / "docs" / "kernels.md").read_text(encoding="utf-8")
    for path in PATHS.values():
        assert f"| {path.name} |" in text, f"docs/kernels.md has no row for {path.name!r}"


def test_doel_serve_prints_the_line_at_start(tiny_bundle, monkeypatch, capsys):
    import uvicorn

    from doel.serve.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.setattr("doel.serve.cli.check_port", lambda host, port: None)  # never serves
    monkeypatch.setenv("DOEL_API_KEY", "k")
    main([str(tiny_bundle)])
    err = capsys.readouterr().err
    assert this_class().line() in err.splitlines()
