"""benchmarks/probes/probe_web_table.py with doel's kernel rows: a row a column did not time (the
single-threaded kernel at 2 threads) or that failed in a host (a build whose self-test fails)
reads so instead of a time, the error column takes the first host that timed the row, and the
"small and fast" verdict only weighs rows timed in that column."""

from __future__ import annotations

from benchmarks.probes import probe_web_table

SHAPES = {"up": [4, 8], "down": [8, 4]}
FP32, NBITS = "fp32 MatMul", "MatMulNBits 4-bit block 256, accuracy level 4"
PLAIN, RELAXED = "doel kernel (plain SIMD)", "doel kernel (relaxed SIMD)"


def row(decode: float, prefill: float, err: float = 0.1) -> dict:
    return {"ms": {"1": decode, "128": prefill}, "err1": err, "err128": err}


def run(kernel: bool, relaxed_ok: bool, relaxed_err: float = 0.2) -> dict:
    out = {}
    for shape in SHAPES:
        out[f"{shape}|{FP32}"] = row(1.0, 10.0, 0.0)
        out[f"{shape}|{NBITS}"] = row(20.0, 15.0)
        if kernel:
            out[f"{shape}|{PLAIN}"] = row(0.5, 12.0)
            bad = {"error": "wrong numbers in this host"}
            out[f"{shape}|{RELAXED}"] = row(0.25, 8.0, relaxed_err) if relaxed_ok else bad
        else:
            out[f"{shape}|{PLAIN}"] = out[f"{shape}|{RELAXED}"] = {"skipped": "single-threaded"}
    return {"result": out}


def fake() -> dict:
    mem = {}
    for shape, (k, n) in SHAPES.items():
        mem |= {f"{shape}|{FP32}": 4 * k * n, f"{shape}|{NBITS}": k * n / 2 + 1}
        mem |= {f"{shape}|{PLAIN}": k * n / 2 + 1, f"{shape}|{RELAXED}": k * n / 2 + 1}
    return {
        "date": "2026-12-03",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "CPU", "isa": {"AVX2": True}, "class": "c"},
        "node": "v20",
        "chromium": "156",
        "runtime": "1.30.0",
        "settings": {"shapes": SHAPES, "rows": [1, 128], "runs": 30, "budget_ms": 300},
        "kernel_sha256": {"doel-kernel.wasm": "0123abcd"},
        "weights_in_memory_bytes": mem,
        "hosts": {
            "node": {"1": run(True, False), "2": run(False, False)},
            "chromium plain": {"1": run(True, True, 0.3), "2": run(False, False)},
        },
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [1.0, 1.0, 1.0],
        "foreign_cpu_s": 0.0,
    }


def table_rows(text: str, heading: str) -> list[str]:
    block = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]


def test_kernel_rows_under_matmulnbits_with_dash_and_host_errors():
    text = probe_web_table.markdown(fake())
    rows = table_rows(text, "## up [1, 4] x [4, 8] (decode step)")
    names = [r.split(" | ")[0].lstrip("| ") for r in rows[1:]]
    assert names == [FP32, NBITS, PLAIN, RELAXED]
    # columns: node 1t, node 2t, chromium plain 1t, chromium plain 2t
    assert rows[3].split(" | ")[1:] == ["0.0", "1.0e-01", "0.50 (0.5x)", "—", "0.50 (0.5x)", "— |"]
    relaxed = rows[4].split(" | ")[1:]
    assert relaxed[1] == "3.0e-01"  # the error of the first host that timed it: Chromium
    assert relaxed[2:] == ["wrong numbers in this host", "—", "0.25 (0.2x)", "— |"]
    assert "sha256 0123abcd" in text and "single-threaded" in text


def test_small_and_fast_weighs_only_rows_timed_in_the_column():
    lines = probe_web_table.small_and_fast(fake())
    assert lines[0].startswith(f"- node, 1 thread(s): {PLAIN}: 0.5x")  # relaxed failed there
    assert lines[1].startswith(f"- node, 2 thread(s): {NBITS}: 20.0x")  # the kernel: no time
    assert lines[2].startswith(f"- chromium plain, 1 thread(s): {RELAXED}: 0.2x")
    assert "0.8x in a prefill chunk" in lines[2]
