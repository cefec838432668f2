"""The CPU a benchmark ran on: model name, ISA flags, class slug (`amd-avx2`, `intel-avx512-amx`,
`arm-i8mm`) that names the result file, and the MLAS path ONNX Runtime gives MatMulNBits there.

The definition is doel/contracts/cpu.py, shared with `doel-serve`'s start line so a result's class
and a user's are spelled the same; this module keeps the benchmarks' import path and prints this
CPU's class (`python -m benchmarks.common.cpu_class`).
"""

from __future__ import annotations

from doel.contracts.cpu import (  # noqa: F401  (the names the benchmarks import from here)
    ISA,
    VENDORS,
    cpu_class,
    describe,
    isa_flags,
    isa_summary,
    parse_cpuinfo,
    this_class,
    this_cpu,
)

if __name__ == "__main__":
    cpu = this_cpu()
    print(f"{cpu['model_name']}: {isa_summary(cpu)} -> {cpu['class']} (MLAS path: {cpu['mlas']})")
