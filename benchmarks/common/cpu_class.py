"""The CPU a benchmark ran on: model name, the ISA flags that decide which int8/int4 kernels ONNX
Runtime and llama.cpp pick, and a class slug (`amd-avx2`, `intel-avx512-amx`, `arm-i8mm`) that
names the result file, so runs on different CPU classes keep one file each instead of one
overwriting the other (issue 22: the same benchmark gave different verdicts on AVX2 and AVX-512).

Read from /proc/cpuinfo (Linux); elsewhere the flags are empty and the class is the vendor or
machine name alone.
"""

from __future__ import annotations

import platform
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


def isa_flags(flags: set[str]) -> dict[str, bool]:
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


def describe(cpuinfo: str, machine: str) -> dict:
    """Model name, ISA flags and class from a /proc/cpuinfo text and `platform.machine()`."""
    fields = parse_cpuinfo(cpuinfo)
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    arm = machine.lower() in ("aarch64", "arm64") or "Features" in fields
    vendor = "arm" if arm else VENDORS.get(fields.get("vendor_id", ""), "x86")
    isa = isa_flags(flags)
    name = fields.get("model name") or fields.get("Model name") or fields.get("CPU part") or machine
    return {"model_name": name, "vendor": vendor, "isa": isa, "class": cpu_class(vendor, isa)}


def this_cpu() -> dict:
    """describe() of the machine this runs on."""
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.is_file() else ""
    return describe(text, platform.machine())


def isa_summary(cpu: dict) -> str:
    """`AVX2, AVX-512F, ...` (the extensions present), or `none of ...` when none is."""
    have = [name for name, on in cpu["isa"].items() if on]
    return ", ".join(have) if have else f"none of {', '.join(cpu['isa'])}"


if __name__ == "__main__":
    cpu = this_cpu()
    print(f"{cpu['model_name']}: {isa_summary(cpu)} -> {cpu['class']}")
