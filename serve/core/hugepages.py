"""The weights on 2 MB pages: a decode step streams them all, and small pages cost it time.

ONNX Runtime repacks each MatMulNBits' weights once, when the session is built, into buffers
of the C heap. Linux backs those with 4 KB pages unless the process asks for larger ones: most
distributions set transparent huge pages to `madvise`, where only memory marked
MADV_HUGEPAGE gets 2 MB pages. A step of SmolLM2-135M reads about 100 MB of weights: 25,000
small pages, each a TLB entry to walk for, against 50 large ones. So, once the session is
built, `collapse` takes the large private anonymous mappings that building it made (`snapshot`
before, `collapse(since=)` after: another model's or the caller's memory is not this engine's
to move) that are (nearly) all resident, and has the kernel move them onto 2 MB pages then and
there (MADV_COLLAPSE, Linux 6.1 and later). What it did to decode and prefill, and what
llama.cpp does: docs/kernels.md ("Huge pages") and benchmarks/results/hugepages_*.

The rules, and why:
- Resident mappings only (RESIDENT of their size): a 2 MB page is taken whole, so a sparse
  mapping (an allocator's reserve) would be charged memory it never touched.
- Collapsed, not marked MADV_HUGEPAGE: what is resident now moves, and what the C heap later
  grows into those mappings stays in small pages, so the memory paid does not creep up.
- Never a mapping marked MADV_NOHUGEPAGE: the engine's KV cache (engine.kv_buffer) is kept in
  small pages on purpose, so that its memory follows the positions in use.
- Only what building the session mapped, and that is known only while no other engine of the
  process runs a step meanwhile (`stepping`, `steps_now`): a stream of another model maps and
  unmaps buffers as it goes, which would pass for this session's, and collapsing them under it
  stalled that stream (tests/serve/core/test_models.py). A model loaded while another streams
  keeps small pages.
- Nothing changes in the memory's contents, only how it is mapped; where the kernel refuses (THP
  `never`, an older kernel, not Linux) nothing happens and the engine runs as before.
- `DOEL_SERVE_HUGEPAGES=0` turns it off (the benchmarks' A/B).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass

HUGE = 2 << 20  # bytes of an x86-64 / arm64 (4 KB granule) transparent huge page
MIN_BYTES = HUGE  # a mapping with one whole 2 MB page inside (one weight matrix may be 7 MB)
RESIDENT = 0.9  # share of a mapping's bytes that must be resident
MADV_COLLAPSE = 25  # <asm-generic/mman-common.h>
SWITCH = "DOEL_SERVE_HUGEPAGES"
_HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$")


@dataclass(frozen=True)
class Mapping:
    lo: int
    hi: int
    perms: str
    inode: int
    path: str
    rss: int = 0
    anon_huge: int = 0  # bytes of it on huge pages now
    flags: tuple[str, ...] = ()


def parse(smaps: str) -> list[Mapping]:
    """/proc/<pid>/smaps as mappings with their resident and huge-page bytes and VmFlags."""
    out: list[dict] = []
    for line in smaps.splitlines():
        head = _HEAD.match(line)
        if head:
            lo, hi, perms, inode, path = head.groups()
            out.append(dict(lo=int(lo, 16), hi=int(hi, 16), perms=perms, inode=int(inode)))
            out[-1]["path"] = path.strip()
        elif out and line.startswith("Rss:"):
            out[-1]["rss"] = int(line.split()[1]) * 1024
        elif out and line.startswith("AnonHugePages:"):
            out[-1]["anon_huge"] = int(line.split()[1]) * 1024
        elif out and line.startswith("VmFlags:"):
            out[-1]["flags"] = tuple(line.split()[1:])
    return [Mapping(**m) for m in out]


_lock = threading.Lock()
_busy = 0  # engine runs in flight in this process
_runs = 0  # engine runs begun in this process


@contextmanager
def stepping():
    """Around every run of an engine's session: what `steps_now` counts."""
    global _busy, _runs
    with _lock:
        _busy, _runs = _busy + 1, _runs + 1
    try:
        yield
    finally:
        with _lock:
            _busy -= 1


def steps_now() -> int | None:
    """The runs this process's engines have begun, or None while one is in flight: equal before
    and after a session's build, no other engine ran meanwhile."""
    with _lock:
        return None if _busy else _runs


def snapshot() -> list[tuple[int, int]]:
    """This process's mappings now, [lo, hi) each: what `collapse(since=)` leaves alone (none
    where `enabled()` says no: nothing will be collapsed)."""
    if not enabled():
        return []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    except OSError:
        return []


def _minus(lo: int, hi: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) without the ranges in `taken`: the parts a mapping grew by since a snapshot."""
    parts = [(lo, hi)]
    for a, b in taken:
        parts = [p for x, y in parts for p in ((x, min(y, a)), (max(x, b), y)) if p[0] < p[1]]
    return parts


def candidates(
    maps: list[Mapping], min_bytes: int = MIN_BYTES, since: list[tuple[int, int]] = ()
) -> list[tuple[int, int]]:
    """The 2 MB-aligned [lo, hi) the rules above allow, outside the ranges of `since`."""
    out = []
    for m in maps:
        anonymous = m.inode == 0 and m.path in ("", "[heap]")
        if not (anonymous and m.perms.startswith("rw") and m.perms[3] == "p"):
            continue
        if "nh" in m.flags or m.rss < RESIDENT * (m.hi - m.lo):
            continue
        for a, b in _minus(m.lo, m.hi, list(since)):
            lo, hi = -(-a // HUGE) * HUGE, b // HUGE * HUGE
            if hi - lo >= min_bytes:
                out.append((lo, hi))
    return out


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(SWITCH, "1") != "0"


def collapse(since: list[tuple[int, int]] = (), min_bytes: int = MIN_BYTES) -> int:
    """Move this process's eligible mappings, but for what `since` (a `snapshot`) held, onto 2 MB
    pages; the bytes the kernel collapsed (0 where it would not, or `enabled()` says no)."""
    if not enabled():
        return 0
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            ranges = candidates(parse(f.read()), min_bytes, since)
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in ranges:
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


def huge_bytes() -> int:
    """This process's anonymous memory on huge pages now (smaps_rollup's AnonHugePages)."""
    try:
        with open("/proc/self/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
