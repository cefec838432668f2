"""The CPU a bundle runs on: its class, and which MLAS kernels ONNX Runtime gives MatMulNBits there.

One definition for everyone who names a CPU: the benchmarks name their result files by the class
(`serve_0.4b_cpu-amd-avx2.md`), and `doel-serve` prints at start which MLAS path this CPU gets, so a
user can find the row of docs/kernels.md (and of the README's results table) that applies to them.

The class is the best int8 path the CPU offers (`amd-avx2`, `intel-avx2-vnni`, `amd-avx512-vnni`,
`intel-avx512-amx`, `arm-i8mm`, ...). The MLAS path is what ONNX Runtime's platform.cpp picks for
4- and 8-bit MatMulNBits from the same flags (docs/kernels.md has the source of each line): AVX2
needs FMA beside it; the AVX-512 tables need AVX-512 F, BW, DQ and VL and win over AVX-VNNI; AMX
and AVX-512 BF16 reach no MatMulNBits kernel (AMX serves MatMulInteger only); on ARM, dot product
(asimddp) brings the int8-activation kernels and i8mm the signed 8-bit one.

Read from /proc/cpuinfo (Linux); elsewhere the flags are empty, the class is the vendor or machine
name alone and the MLAS path says it is not known.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

# Reported name -> the kernel flags as Linux spells them (x86 `flags`, ARM `Features`).
ISA = {
    "AVX2": ("avx2",),
    "AVX-512F": ("avx512f",),
    "AVX-512 VNNI": ("avx512_vnni",),
    "AVX-VNNI": ("avx_vnni",),
    "AVX-512 BF16": ("avx512_bf16",),
    "AMX": ("amx_tile", "amx_int8"),
    "ARM dotprod": ("asimddp",),
    "ARM i8mm": ("i8mm",),
}
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
# Cores of one class can differ twofold in a compute-bound step (Zen 5 runs AVX-512 on full-width
# units, Zen 4 in two halves), so a result also names the core: AMD's by family, Intel's server
# cores by model. A core missing here is named by its numbers alone.
AMD_CORES = {23: "Zen or Zen 2", 25: "Zen 3 or Zen 4", 26: "Zen 5"}
INTEL_CORES = {
    85: "Skylake or Cascade Lake",
    106: "Ice Lake",
    143: "Sapphire Rapids",
    207: "Emerald Rapids",
    173: "Granite Rapids",
    151: "Alder Lake",
    183: "Raptor Lake",
}
AVX512_CORE = ("avx512f", "avx512bw", "avx512dq", "avx512vl")  # platform.cpp's Avx512Supported_


@dataclass(frozen=True)
class MlasPath:
    """One MLAS dispatch for MatMulNBits: its name (a row of docs/kernels.md) and what the 4- and
    8-bit weights of a doel bundle (accuracy level 4) run there."""

    name: str
    int4: str
    int8: str


INT8_ACTIVATIONS = "int8 activations"
DEQUANTIZED = "no MLAS kernel: the weights are dequantized to fp32 on every call"
PATHS = {
    "avx512-vnni": MlasPath(
        "AVX-512 VNNI", f"{INT8_ACTIVATIONS}, VNNI dot products", f"{INT8_ACTIVATIONS}"
    ),
    "avx512": MlasPath("AVX-512", f"{INT8_ACTIVATIONS}, no VNNI", f"{INT8_ACTIVATIONS}"),
    "avx2-vnni": MlasPath(
        "AVX2 + AVX-VNNI",
        f"{INT8_ACTIVATIONS}, AVX-VNNI dot products",
        f"{INT8_ACTIVATIONS}, AVX-VNNI dot products",
    ),
    "avx2": MlasPath(
        "AVX2",
        f"{INT8_ACTIVATIONS}, no VNNI (two instructions a dot product)",
        f"{INT8_ACTIVATIONS}, no VNNI (two instructions a dot product)",
    ),
    "x86": MlasPath("none (no AVX2 + FMA)", DEQUANTIZED, DEQUANTIZED),
    "arm-i8mm": MlasPath(
        "NEON + i8mm",
        f"{INT8_ACTIVATIONS}, dot products (KleidiAI where the build has it)",
        f"{INT8_ACTIVATIONS}, signed",
    ),
    "arm-dotprod": MlasPath(
        "NEON + dotprod",
        f"{INT8_ACTIVATIONS}, dot products (KleidiAI where the build has it)",
        f"unsigned {INT8_ACTIVATIONS} and one more correction GEMM",
    ),
    "arm": MlasPath("NEON", "fp32 activations (no int8 kernel without dotprod)", DEQUANTIZED),
    # No flags to read (no /proc/cpuinfo: macOS, Windows): say so rather than guess a path.
    "unknown": MlasPath("unknown (no /proc/cpuinfo)", "not known here", "not known here"),
}


@dataclass(frozen=True)
class CpuClass:
    """A CPU as the project names it: `slug` names result files, `mlas` is the MatMulNBits path."""

    slug: str
    mlas: MlasPath

    def line(self) -> str:
        """The one line `doel-serve` prints at start."""
        return (
            f"MLAS path: {self.mlas.name} (int4 MatMulNBits: {self.mlas.int4}; "
            f"int8: {self.mlas.int8}); CPU class {self.slug}: see its row in docs/kernels.md"
        )


def parse_cpuinfo(text: str) -> dict:
    """The first processor's fields of a /proc/cpuinfo text (x86 or ARM)."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # one processor is enough: they all share the same flags here
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def isa_flags(flags: set[str] | frozenset[str]) -> dict[str, bool]:
    """Each ISA extension of ISA: present (all its kernel flags set) or not."""
    return {name: all(f in flags for f in need) for name, need in ISA.items()}


def cpu_class(vendor: str, isa: dict[str, bool]) -> str:
    """The slug of the best int8 path the CPU offers: what decides the quantized kernels' speed.
    x86: `<vendor>-avx512-amx`, `-avx512-vnni`, `-avx512`, `-avx2-vnni`, `-avx2`, `-sse`;
    ARM: `arm-i8mm`, `arm-dotprod`, `arm`."""
    if vendor == "arm":
        if isa["ARM i8mm"]:
            return "arm-i8mm"
        return "arm-dotprod" if isa["ARM dotprod"] else "arm"
    if isa["AVX-512F"]:
        tier = "avx512-amx" if isa["AMX"] else "avx512-vnni" if isa["AVX-512 VNNI"] else "avx512"
    elif isa["AVX2"]:
        tier = "avx2-vnni" if isa["AVX-VNNI"] else "avx2"
    else:
        tier = "sse"
    return f"{vendor}-{tier}"


def mlas_path(flags: set[str] | frozenset[str], arm: bool) -> MlasPath:
    """The MatMulNBits dispatch ONNX Runtime's platform.cpp picks for these kernel flags."""
    if not flags:
        return PATHS["unknown"]
    if arm:
        return PATHS[
            "arm-i8mm" if "i8mm" in flags else "arm-dotprod" if "asimddp" in flags else "arm"
        ]
    if not {"avx2", "fma"} <= flags:
        return PATHS["x86"]
    if all(f in flags for f in AVX512_CORE):
        return PATHS["avx512-vnni" if "avx512_vnni" in flags else "avx512"]
    return PATHS["avx2-vnni" if "avx_vnni" in flags else "avx2"]


def classify(flags: set[str] | frozenset[str], vendor: str) -> CpuClass:
    """The class and MLAS path of a CPU with these kernel flags; `vendor` is "intel", "amd",
    "arm", or another x86 name."""
    slug = cpu_class(vendor, isa_flags(flags))
    return CpuClass(slug, mlas_path(flags, vendor == "arm"))


def _read(cpuinfo: str, machine: str) -> tuple[dict, set[str], str]:
    """The first processor's fields, its kernel flags and the vendor ("arm" on ARM)."""
    fields = parse_cpuinfo(cpuinfo)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    arm = machine.lower() in ("aarch64", "arm64") or "Features" in fields
    return fields, flags, "arm" if arm else VENDORS.get(fields.get("vendor_id", ""), "x86")


def core(fields: dict, vendor: str, isa: dict[str, bool]) -> str:
    """`Zen 4 (family 25, model 17)`: the core behind the model name, where /proc/cpuinfo says."""
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if not (family.isdigit() and model.isdigit()):
        return ""
    name = {"amd": AMD_CORES.get(int(family)), "intel": INTEL_CORES.get(int(model))}.get(vendor)
    if vendor == "amd" and int(family) == 25:  # Zen 3 has no AVX-512; Zen 4 does
        name = "Zen 4" if isa["AVX-512F"] else "Zen 3"
    numbers = f"family {family}, model {model}"
    return f"{name} ({numbers})" if name else numbers


def describe(cpuinfo: str, machine: str) -> dict:
    """Model name, ISA flags, class and MLAS path from a /proc/cpuinfo text and
    `platform.machine()`: what a result records of the CPU it ran on."""
    fields, flags, vendor = _read(cpuinfo, machine)
    name = fields.get("model name") or fields.get("Model name") or fields.get("CPU part") or machine
    found = classify(flags, vendor)
    isa = isa_flags(flags)
    return {
        "model_name": name,
        "core": core(fields, vendor, isa),
        "vendor": vendor,
        "isa": isa,
        "class": found.slug,
        "mlas": found.mlas.name,
    }


def cpuinfo_text() -> str:
    """/proc/cpuinfo, or "" where there is none."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


def this_cpu() -> dict:
    """describe() of the machine this runs on."""
    return describe(cpuinfo_text(), platform.machine())


def this_class() -> CpuClass:
    """classify() of the machine this runs on."""
    _, flags, vendor = _read(cpuinfo_text(), platform.machine())
    return classify(flags, vendor)


def isa_summary(cpu: dict) -> str:
    """`AVX2, AVX-512F, ...` (the extensions present), or `none of ...` when none is."""
    have = [name for name, on in cpu["isa"].items() if on]
    return ", ".join(have) if have else f"none of {', '.join(cpu['isa'])}"
