"""The CPU class of a result, from /proc/cpuinfo's flags (x86 and ARM)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench(name: str = "serve.bench_serve"):
    """A script of benchmarks/ as the module `benchmarks.NAME` (the package the root holds)."""
    return importlib.import_module(f"benchmarks.{name}")


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
    from benchmarks.common.cpu_class import describe

    cpu = describe(_cpuinfo(vendor, "Some CPU", flags), "x86_64")
    assert cpu["class"] == slug and cpu["model_name"] == "Some CPU"
    assert cpu["isa"]["AVX2"] == ("avx2" in flags) and not cpu["isa"]["ARM i8mm"]
    assert cpu["isa"]["AVX-VNNI"] == ("avx_vnni" in flags)


def test_cpu_class_reads_arm_features_and_names_the_result_file():
    bench = _bench()
    from benchmarks.common.cpu_class import describe, this_cpu

    graviton3 = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics asimddp sve i8mm bf16\n"
    cpu = describe(graviton3 + "CPU part\t: 0xd40\n", "aarch64")
    assert cpu["class"] == "arm-i8mm" and cpu["isa"]["ARM dotprod"] and not cpu["isa"]["AVX2"]
    assert describe("Features\t: fp asimd asimddp\n", "aarch64")["class"] == "arm-dotprod"
    assert describe("Features\t: fp asimd\n", "aarch64")["class"] == "arm"
    assert describe("", "x86_64")["model_name"] == "x86_64"  # no /proc/cpuinfo: still a name
    assert bench.result_name("bangla-0.4b", "amd-avx2") == "serve_0.4b_cpu-amd-avx2"
    assert bench.result_name("tiny", this_cpu()["class"]).startswith("serve_tiny_cpu-")


@pytest.mark.parametrize(
    "vendor, family, model, flags, core",
    [
        ("AuthenticAMD", 25, 1, ZEN3, "Zen 3 (family 25, model 1)"),
        ("AuthenticAMD", 25, 17, ZEN5, "Zen 4 (family 25, model 17)"),  # same flags, Zen 4
        ("AuthenticAMD", 26, 2, ZEN5, "Zen 5 (family 26, model 2)"),
        ("GenuineIntel", 6, 143, SAPPHIRE_RAPIDS, "Sapphire Rapids (family 6, model 143)"),
        ("GenuineIntel", 6, 250, ALDER_LAKE, "family 6, model 250"),  # not named: numbers
    ],
)
def test_a_result_names_the_core_two_cpus_of_one_class_can_differ_in(
    vendor, family, model, flags, core
):
    from benchmarks.common.cpu_class import describe
    from benchmarks.common.report import cpu_name

    text = _cpuinfo(vendor, "EPYC", flags).replace(
        "model name", f"cpu family\t: {family}\nmodel\t\t: {model}\nmodel name", 1
    )
    cpu = describe(text, "x86_64")
    assert cpu["core"] == core
    assert cpu_name(cpu) == f"EPYC ({core}), class **{cpu['class']}**"
    assert describe(_cpuinfo(vendor, "EPYC", flags), "x86_64")["core"] == ""  # not in the file
