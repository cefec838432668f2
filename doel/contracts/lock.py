"""One writer a folder at a time: `prepare`, `fit`, `sft` and `doel-export` hold an OS lock on the
folder they write while they write it, and a second process aimed at the same folder stops with a
line naming the holder's PID.

The lock is `flock` on a hidden file beside the folder (`.NAME.lock`; beside, not inside, because
an export replaces its folder by a rename). The kernel releases it when the holder's process ends,
however it ends, so a `kill -9` leaves nothing to clean: the file may stay, unlocked, and the next
writer takes it. A holder removes the file before it lets go; a taker that finds its file unlinked
under it in between opens the new one, so two processes never both hold "the" lock. The file is
opened close-on-exec: a program the holder starts does not keep the folder locked after it dies.
Where `fcntl` does not exist (Windows), nothing is locked.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows: no flock)
    fcntl = None


def lock_path(folder: str | os.PathLike) -> Path:
    """The lock file of `folder`: `.NAME.lock` in its parent, after resolving links, so every
    spelling of one folder reaches one lock; `.doel.lock` inside it where the parent is not
    writable (a run folder made for its user in a shared one) and the folder exists."""
    folder = Path(folder).resolve()
    if folder.is_dir() and not os.access(folder.parent, os.W_OK | os.X_OK):
        return folder / ".doel.lock"
    return folder.parent / f".{folder.name}.lock"


class FolderLock:
    """`with FolderLock(out, "doel-train fit", DoelError):` — raise `error` (the stage's one-line
    error) naming the holder when another process holds `out`. `acquire` and `release` do the
    same without a `with` block (a run whose rank 0 alone locks)."""

    def __init__(self, folder, what: str, error: type[Exception] = RuntimeError):
        self.folder, self.what, self.error = Path(folder), what, error
        self.path = lock_path(folder)
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        if fcntl is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise self.error(
                    f"{self.folder} is in use by {holder}; two writers would corrupt each "
                    "other's files: wait for it to end, or choose another --out"
                ) from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {self.what}\n".encode(), 0)
                self._fd = fd
                return self
            os.close(fd)  # its holder removed it as we opened it: take the new one
        raise self.error(f"cannot lock {self.folder}: {self.path} keeps being replaced")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while held: a taker that opened it before sees it is gone
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """ "process 1234 (doel-train fit)" from what the holder wrote, or a plain phrase."""
    try:
        pid, _, what = os.pread(fd, 256, 0).decode("utf-8", "replace").strip().partition(" ")
    except OSError:
        pid = ""
    if not pid.isdigit():
        return "another process"
    return f"process {pid} ({what})" if what else f"process {pid}"


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
