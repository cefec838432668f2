"""The machine's streaming-read bandwidth, as a decode step reads its weights (issue 57).

A memory-bound decode step reads every weight once per token; its bound is those bytes over
what the cores can stream from memory. The earlier probe summed a float32 array with numpy
(pairwise summation, one add chain a lane): on the AVX-512 host it read so much less than the
memory gives that doel's decode came out at 106-134 % of "the bound". This probe is STREAM's
read kernel (McCalpin's STREAM benchmark, its idea, not its code): a few lines of C, compiled
here once with `-O3 -march=native`, that add up a buffer of 64-bit words with eight independent
accumulators (the compiler vectorizes them; integer adds keep it exact without -ffast-math),
over a buffer far larger than the last-level cache (512 MiB against 32 MiB here), split
between as many threads as ONNX Runtime runs (ctypes lets go of the GIL during the call), best
of several passes. The copy figure is memcpy over the same halves.

Where no C compiler is at hand the numpy sum is used, and the result says so (`method`). Both
figures are in every result: `numpy_sum_gb_s` is the old probe's reading in the same run.
Run alone: `python -m benchmarks.probes.probe_stream` prints one reading (no result file:
bench_serve and profile_serve record theirs; probe_ablation records its own).
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CACHE = Path.home() / ".cache" / "doel" / "stream-probe"
THREADS = 2
SOURCE = r"""
#include <stdint.h>
#include <string.h>
uint64_t doel_read(const uint64_t *p, size_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
        s4 += p[i + 4]; s5 += p[i + 5]; s6 += p[i + 6]; s7 += p[i + 7];
    }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
}
void doel_copy(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
"""
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]


def kernel(cache: Path = CACHE) -> ctypes.CDLL | None:
    """The compiled read and copy kernels (built once, keyed by source and flags), or None
    where no compiler builds them."""
    key = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:12]
    lib = cache / f"stream-{key}.so"
    if not lib.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        src = cache / f"stream-{key}.c"
        src.write_text(SOURCE)
        tmp = lib.with_suffix(".tmp")
        try:
            subprocess.run(
                ["cc", *FLAGS, str(src), "-o", str(tmp)], check=True, capture_output=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        tmp.replace(lib)  # atomic: a concurrent probe never loads half a file
    so = ctypes.CDLL(str(lib))
    so.doel_read.restype = ctypes.c_uint64
    so.doel_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    so.doel_copy.restype = None
    so.doel_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return so


def _best(ex: ThreadPoolExecutor, fn, parts: list, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        list(ex.map(fn, parts))
        times.append(time.perf_counter() - t0)
    return min(times)


def bandwidth(threads: int = THREADS, mib: int = 512, repeats: int = 5) -> dict:
    """Best read and copy GB/s of `threads` threads over a `mib` MiB buffer (halves a thread),
    by the C kernel where it builds, and the numpy sum's read beside it."""
    import numpy as np

    a = np.ones(mib * 2**20 // 8, np.uint64)
    b = np.empty_like(a)
    parts = list(zip(np.array_split(a, threads), np.array_split(b, threads)))
    floats = [p.view(np.float32) for p, _ in parts]
    so = kernel()
    with ThreadPoolExecutor(threads) as ex:
        numpy_read = a.nbytes / _best(ex, lambda p: p.sum(), floats, repeats) / 1e9
        if so is None:
            read, method = numpy_read, "numpy float32 sum (no C compiler)"
            copy_s = _best(ex, lambda p: np.copyto(p[1], p[0]), parts, repeats)
        else:
            read_s = _best(ex, lambda p: so.doel_read(p[0].ctypes.data, p[0].size), parts, repeats)
            read, method = (
                a.nbytes / read_s / 1e9,
                "C read, 8 uint64 accumulators, -O3 -march=native",
            )
            copy_s = _best(
                ex,
                lambda p: so.doel_copy(p[1].ctypes.data, p[0].ctypes.data, p[0].nbytes),
                parts,
                repeats,
            )
    return {
        "read_gb_s": read,
        "copy_gb_s": 2 * a.nbytes / copy_s / 1e9,
        "numpy_sum_gb_s": numpy_read,
        "method": method,
        "threads": threads,
        "array_mib": mib,
    }


def main() -> None:
    bw = bandwidth()
    print(
        f"read {bw['read_gb_s']:.1f} GB/s ({bw['method']}), copy {bw['copy_gb_s']:.1f}, "
        f"numpy sum {bw['numpy_sum_gb_s']:.1f}; {bw['threads']} threads, {bw['array_mib']} MiB"
    )


if __name__ == "__main__":
    main()
