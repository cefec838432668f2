"""What a process costs the system's memory, read from /proc (Linux): the one meter that serve's
tests and the benchmarks read.

Resident memory (RSS, VmRSS) is the wrong figure to judge memory by, two ways. It counts a page
shared between processes whole in each of them (a library, a model file's cached pages), so a
process tree's sum overstates. And it cannot see what a process made and no longer maps: pages
of a shared-writable anonymous mapping (`mmap` with MAP_SHARED and no file, a memfd, SysV shared
memory) live in the kernel's shmem, and MADV_DONTNEED on them drops only the mapping, not the
pages, so RSS falls while the machine's (and a container's) memory stays where it was. That is
how serve's KV cache once "gave back" memory it still held (docs/serving.md#memory).

So the meter reads, for a process or its whole tree:

- Pss, the proportional set size (/proc/PID/smaps_rollup): private pages plus each shared page
  divided by the number of processes mapping it, so a tree's sum is what the system pays for
  what the tree maps;
- every shared-writable anonymous mapping (/proc/PID/maps: `rw-s` on /dev/zero, memfd: or
  SYSV), whose released pages no per-process figure sees: where there is one, Pss is a lower
  bound and `complete` is False;
- the `memory.current` of the process's own cgroup v2 (/proc/PID/cgroup, under
  /sys/fs/cgroup), what a container's limit is held against. It includes the page cache of
  files the cgroup read (a bundle's weights once loaded), so it is no process's own figure; None
  where there is no cgroup v2 memory controller to read (cgroup v1, the root cgroup, no /sys).

Standard library only, as all of doel.contracts; on a system without /proc the figures are 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
# /proc/PID/maps names of shared anonymous memory: mmap(MAP_SHARED | MAP_ANONYMOUS), memfd_create,
# shmget. Their pages stay in shmem when a process drops its mapping of them.
SHARED_ANON = ("/dev/zero", "/memfd:", "/SYSV")


@dataclass(frozen=True)
class Memory:
    """One reading of a process (or its tree); bytes."""

    pss_bytes: int  # what the system pays: private pages + a fair share of each shared one
    rss_bytes: int  # resident pages mapped, each shared one whole (VmRSS's figure)
    private_bytes: int  # pages only this process maps (Private_Clean + Private_Dirty)
    shmem_mappings: tuple[str, ...]  # shared-writable anonymous mappings ("RANGE NAME")
    cgroup_bytes: int | None  # the cgroup's memory.current, page cache included; None: unread

    @property
    def complete(self) -> bool:
        """Whether Pss is the whole cost: no shared anonymous mapping hides released pages."""
        return not self.shmem_mappings

    @property
    def pss_mb(self) -> float:
        return self.pss_bytes / 2**20

    @property
    def rss_mb(self) -> float:
        return self.rss_bytes / 2**20


def _sizes(lines: Iterable[str]) -> dict[str, int]:
    """Pss, Rss and private bytes summed over smaps-style `Key: N kB` lines."""
    got = {"Pss": 0, "Rss": 0, "Private": 0}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("Pss", "Rss") or key in ("Private_Clean", "Private_Dirty"):
            kib = int(rest.split()[0])
            got["Private" if key.startswith("Private") else key] += kib * 1024
    return got


def _shared_anon(head: list[str]) -> str | None:
    """ "START-END NAME" of a maps/smaps header line split in six, if it is shared-writable
    anonymous memory (perms rw-s, a SHARED_ANON name)."""
    if len(head) == 6 and head[1][:2] == "rw" and head[1][3:] == "s":
        name = head[5].strip()
        if name.startswith(SHARED_ANON):
            return f"{head[0]} {name}"
    return None


def shmem_mappings(pid: int) -> tuple[str, ...]:
    """The shared-writable anonymous mappings of `pid` ("START-END NAME"); () if it is gone."""
    try:
        with open(PROC / str(pid) / "maps") as f:
            found = [_shared_anon(line.split(maxsplit=5)) for line in f]
    except OSError:
        return ()
    return tuple(m for m in found if m)


def cgroup_bytes(pid: int, proc: Path = PROC, cgroup: Path = CGROUP) -> int | None:
    """memory.current of `pid`'s cgroup v2 (the `0::PATH` line of /proc/PID/cgroup), or None."""
    try:
        for line in (proc / str(pid) / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                path = cgroup / line[3:].lstrip("/") / "memory.current"
                return int(path.read_text())
    except (OSError, ValueError):
        pass
    return None


def _one(pid: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """Sizes of one process (smaps_rollup, else smaps summed: Linux before 4.14), and its
    shared anonymous mappings; zeros for a process gone or unreadable."""
    for name in ("smaps_rollup", "smaps"):
        try:
            with open(PROC / str(pid) / name) as f:
                return _sizes(f), shmem_mappings(pid)
        except OSError:
            continue
    return _sizes(()), ()


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/*/stat), `pid` first."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir(PROC) if PROC.is_dir() else ():
        if d.isdigit():
            try:
                stat = (PROC / d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces, ")"
            parents.setdefault(ppid, []).append(int(d))
    out, frontier = [pid], [pid]
    while frontier:
        kids = [c for c in parents.get(frontier.pop(), ()) if c not in out]
        out += kids
        frontier += kids
    return out


def measure(pid: int | None = None, whole_tree: bool = False) -> Memory:
    """The memory of `pid` (this process by default), or of it and all its descendants summed;
    the cgroup figure is `pid`'s own cgroup's."""
    pid = os.getpid() if pid is None else pid
    total = {"Pss": 0, "Rss": 0, "Private": 0}
    shared: list[str] = []
    for p in tree(pid) if whole_tree else [pid]:
        sizes, maps = _one(p)
        total = {k: total[k] + sizes[k] for k in total}
        shared += [f"{m} (pid {p})" if whole_tree else m for m in maps]
    return Memory(
        pss_bytes=total["Pss"],
        rss_bytes=total["Rss"],
        private_bytes=total["Private"],
        shmem_mappings=tuple(shared),
        cgroup_bytes=cgroup_bytes(pid),
    )


def mappings(addresses: Iterable[int], pid: int | None = None) -> Memory:
    """The same figures over only the mappings of `pid` that hold one of `addresses` (a
    buffer's: numpy's `a.ctypes.data`), from /proc/PID/smaps; no cgroup figure."""
    starts = sorted(set(addresses))
    pid = os.getpid() if pid is None else pid
    picked: list[str] = []
    shared: list[str] = []
    inside = False
    try:
        with open(PROC / str(pid) / "smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    inside = any(lo <= s < hi for s in starts)
                    if inside and _shared_anon(head):
                        shared.append(_shared_anon(head))
                elif inside:
                    picked.append(line)
    except OSError:
        pass
    sizes = _sizes(picked)
    return Memory(sizes["Pss"], sizes["Rss"], sizes["Private"], tuple(shared), None)


def available_bytes(proc: Path = PROC) -> int | None:
    """What the system can still give without swapping (/proc/meminfo MemAvailable), or None
    where it does not say (not Linux)."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
