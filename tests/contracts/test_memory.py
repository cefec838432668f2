"""doel.contracts.memory: Pss of a child that maps and writes memory, its tree's sum, shared
anonymous mappings flagged (their released pages stay in shmem, out of Pss's sight), and the
cgroup v2 figure read from the process's own cgroup."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from doel.contracts import memory

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc (Linux)")

MIB = 2**20
SIZE = 64 * MIB

# A child that maps SIZE bytes (FLAGS: mmap's), writes every page when told, and (with KIDS)
# starts a child of its own that does the same; one line out after each stage.
CHILD = textwrap.dedent(
    """
    import mmap, subprocess, sys
    size, flags, kids = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    buf = mmap.mmap(-1, size, flags=flags)
    kid = None
    if kids:
        argv = [sys.executable, "-c", sys.argv[4], sys.argv[1], sys.argv[2], "0", sys.argv[4]]
        kid = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        kid.stdout.readline()
    print("mapped", flush=True)
    sys.stdin.readline()
    for i in range(0, size, mmap.PAGESIZE):
        buf[i] = 7
    if kid:
        kid.stdin.write("go\\n"); kid.stdin.flush(); kid.stdout.readline()
    print("written", flush=True)
    sys.stdin.readline()
    """
)


class Child:
    """The CHILD script in a process; `step()` moves it to its next stage."""

    def __init__(self, flags: int = mmap.MAP_PRIVATE, kids: int = 0):
        args = [str(SIZE), str(flags), str(kids), CHILD]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "mapped"

    def step(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "written"

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate()  # waits, and closes the pipes


def test_a_childs_written_memory_is_in_its_pss_private_and_rss():
    child = Child()
    try:
        before = memory.measure(child.proc.pid)
        child.step()
        after = memory.measure(child.proc.pid)
    finally:
        child.close()
    for field in ("pss_bytes", "private_bytes", "rss_bytes"):
        grew = getattr(after, field) - getattr(before, field)
        assert SIZE * 0.95 <= grew <= SIZE * 1.2, (field, grew)
    assert after.complete and after.shmem_mappings == ()
    assert after.pss_bytes <= after.rss_bytes


def test_a_tree_sums_its_processes_and_one_process_is_only_its_own():
    child = Child(kids=1)
    try:
        child.step()  # it and its own child have each written SIZE
        alone = memory.measure(child.proc.pid)
        both = memory.measure(child.proc.pid, whole_tree=True)
        family = memory.tree(child.proc.pid)
    finally:
        child.close()
    assert len(family) == 2 and family[0] == child.proc.pid
    assert both.pss_bytes - alone.pss_bytes >= SIZE * 0.95
    assert alone.pss_bytes >= SIZE * 0.95


def test_a_shared_anonymous_mapping_is_flagged_whose_pages_pss_cannot_see():
    child = Child(flags=mmap.MAP_SHARED)
    try:
        child.step()
        got = memory.measure(child.proc.pid)
    finally:
        child.close()
    assert not got.complete
    assert any("/dev/zero" in m for m in got.shmem_mappings)


def test_a_memfd_is_flagged_and_a_private_mapping_is_not():
    fd = os.memfd_create("doel-test")
    try:
        os.ftruncate(fd, MIB)
        shared = mmap.mmap(fd, MIB)  # MAP_SHARED of the memfd
        private = mmap.mmap(-1, MIB, flags=mmap.MAP_PRIVATE)
        mine = memory.shmem_mappings(os.getpid())
        assert any("/memfd:doel-test" in m for m in mine)
        shared.close()
        assert not any("/memfd:doel-test" in m for m in memory.shmem_mappings(os.getpid()))
        private.close()
    finally:
        os.close(fd)


def test_mappings_measures_only_the_buffers_asked_for():
    import numpy as np

    private = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE)
    shared = mmap.mmap(-1, MIB)  # MAP_SHARED: Python's default
    a, b = np.frombuffer(private, np.uint8), np.frombuffer(shared, np.uint8)
    # The system may merge a new anonymous mapping with a neighbour of the same flags (smaps
    # then shows one region): what the buffer's pages add is what is asserted.
    before = memory.mappings([a.ctypes.data]).pss_bytes
    a[::4096] = 1
    b[::4096] = 1
    got = memory.mappings([a.ctypes.data])
    assert 8 * MIB <= got.pss_bytes - before <= 8 * MIB + 64 * 1024 and got.complete
    both = memory.mappings([a.ctypes.data, b.ctypes.data])
    assert both.pss_bytes >= got.pss_bytes + MIB and not both.complete
    del a, b


def test_a_process_gone_reads_zero():
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    got = memory.measure(int(proc.stdout))
    assert (got.pss_bytes, got.rss_bytes, got.private_bytes) == (0, 0, 0)


def test_cgroup_bytes_reads_the_processs_own_cgroup_v2_and_none_without_one(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "7").mkdir(parents=True)
    (cgroup / "box" / "app").mkdir(parents=True)
    (cgroup / "box" / "app" / "memory.current").write_text("123456\n")
    (proc / "7" / "cgroup").write_text("4:memory:/elsewhere\n0::/box/app\n")
    assert memory.cgroup_bytes(7, proc, cgroup) == 123456
    (proc / "7" / "cgroup").write_text("4:memory:/box/app\n")  # cgroup v1 only
    assert memory.cgroup_bytes(7, proc, cgroup) is None
    (proc / "7" / "cgroup").write_text("0::/\n")  # the root: no memory.current
    assert memory.cgroup_bytes(7, proc, cgroup) is None
    assert memory.cgroup_bytes(8, proc, cgroup) is None  # no such process


def test_available_bytes_reads_memavailable_and_says_none_where_there_is_none(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert memory.available_bytes(tmp_path) == 2048 * 1024
    assert memory.available_bytes(tmp_path / "absent") is None
    assert memory.available_bytes(Path("/proc")) > 0  # this machine's own
