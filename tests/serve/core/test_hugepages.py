"""The weights onto 2 MB pages (serve/core/hugepages.py): which mappings qualify, that the
kernel really moves them and nothing in them changes, that the KV cache's small pages are left
alone, and the switch."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from doel.serve.core import hugepages
from doel.serve.core.engine import Engine, kv_buffer, read_bundle

MB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _entry(lo, hi, perms="rw-p", inode=0, path="", rss=None, flags="rd wr mr mw me ac", huge=0):
    rss_kb = (hi - lo) // 1024 if rss is None else rss // 1024
    return (
        f"{lo:x}-{hi:x} {perms} 00000000 00:00 {inode} {path}\n"
        f"Size: {(hi - lo) // 1024} kB\nRss: {rss_kb} kB\nAnonHugePages: {huge // 1024} kB\n"
        f"VmFlags: {flags}\n"
    )


def test_only_resident_private_anonymous_mappings_qualify_cut_to_whole_2mb_pages():
    base = 0x7F0000000000
    text = "".join(
        [
            _entry(base + 4096, base + 20 * MB + 4096),  # unaligned: 18 MB inside it qualify
            _entry(base + 32 * MB, base + 48 * MB, flags="rd wr mr mw me ac nh"),  # the cache's
            _entry(base + 64 * MB, base + 96 * MB, rss=3 * MB),  # sparse: a reserve
            _entry(base + 128 * MB, base + 160 * MB, inode=42, path="/x/model.onnx.data"),
            _entry(base + 192 * MB, base + 224 * MB, perms="rw-s"),  # shared: shmem
            _entry(base + 256 * MB + 4096, base + 258 * MB + 4096),  # no whole 2 MB page inside
            _entry(base + 288 * MB, base + 320 * MB, perms="r--p"),  # read-only
            _entry(0x55000000 * 2, 0x55000000 * 2 + 16 * MB, path="[heap]", huge=4 * MB),
        ]
    )
    maps = hugepages.parse(text)
    assert len(maps) == 8 and maps[1].flags[-1] == "nh" and maps[2].rss == 3 * MB
    assert maps[0].anon_huge == 0 and maps[7].anon_huge == 4 * MB
    heap = 0x55000000 * 2
    assert hugepages.candidates(maps) == [(base + 2 * MB, base + 20 * MB), (heap, heap + 16 * MB)]
    # what a snapshot held stays: the first mapping as it was, the heap's first 6 MB before it grew
    since = [(base + 4096, base + 20 * MB + 4096), (heap, heap + 6 * MB)]
    assert hugepages.candidates(maps, since=since) == [(heap + 6 * MB, heap + 16 * MB)]


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(hugepages.SWITCH, "0")
    assert not hugepages.enabled() and hugepages.collapse() == 0
    assert hugepages.snapshot() == []  # nothing read at start-up for a collapse that will not run


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    maps = hugepages.parse(Path("/proc/self/smaps").read_text())
    (held,) = [m for m in maps if m.lo <= address < m.hi]
    return held.anon_huge // 1024


@pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to never",
)
def test_the_kernel_moves_a_resident_buffer_and_leaves_its_bytes_and_the_kv_cache_alone():
    older = mmap.mmap(-1, 24 * MB, flags=mmap.MAP_PRIVATE)  # mapped before the snapshot
    older.madvise(mmap.MADV_DONTFORK)  # a flag of its own: the kernel cannot merge it with `buf`
    older.write(b"\x01" * (24 * MB))
    since = hugepages.snapshot()
    buf = mmap.mmap(-1, 24 * MB, flags=mmap.MAP_PRIVATE)
    weights = np.frombuffer(buf, np.uint8)
    weights[:] = np.random.default_rng(0).integers(0, 256, weights.size, dtype=np.uint8)
    before = weights.copy()
    cache, cache_map = kv_buffer((1, 8, 8192, 64), np.float32)  # 16 MB, as the engine reserves
    cache[:] = 1.5  # every page resident, as a full context leaves it
    older_at = np.frombuffer(older, np.uint8).ctypes.data
    older_huge = _huge_kb(older_at)  # 0 where THP is madvise; "always" may have given it some
    done = hugepages.collapse(since=since)
    if done == 0:
        pytest.skip("this kernel collapses nothing (MADV_COLLAPSE needs Linux 6.1)")
    assert _huge_kb(weights.ctypes.data) >= 20 * 1024  # 22 of its 24 MB are whole 2 MB pages
    assert np.array_equal(weights, before)
    assert _huge_kb(cache.ctypes.data) == 0 and (cache == 1.5).all()
    assert _huge_kb(older_at) == older_huge  # what the snapshot held was left as it was
    assert hugepages.huge_bytes() >= 20 * MB
    del weights, cache
    buf.close()
    cache_map.close()
    older.close()


def test_an_engine_built_with_it_off_gives_the_same_logits(tiny_bundle, monkeypatch):
    ids = [0, 398, 841, 405, 679]
    on = Engine(read_bundle(tiny_bundle), threads=1)
    monkeypatch.setenv(hugepages.SWITCH, "0")
    off = Engine(read_bundle(tiny_bundle), threads=1)
    assert off.huge_bytes == 0 and on.huge_bytes >= 0
    assert np.array_equal(on.forward(ids, 0), off.forward(ids, 0))


def test_runs_are_counted_and_one_in_flight_reads_as_none():
    n = hugepages.steps_now()
    with hugepages.stepping():
        assert hugepages.steps_now() is None
    assert hugepages.steps_now() == n + 1


def test_an_engine_built_while_another_runs_leaves_the_pages_alone(tiny_bundle, monkeypatch):
    """What a running engine maps during the build would pass for the new session's: nothing is
    collapsed then (it stalled that engine's stream: tests/serve/core/test_models.py)."""
    calls = []
    monkeypatch.setattr(hugepages, "collapse", lambda since=(): calls.append(since) or 7)
    bundle = read_bundle(tiny_bundle)
    assert Engine(bundle, threads=1).huge_bytes == 7 and len(calls) == 1
    with hugepages.stepping():  # another engine's step in flight
        assert Engine(bundle, threads=1).huge_bytes == 0 and len(calls) == 1
