"""The servers of the load benchmark: doel-serve and llama.cpp's own `llama-server`, each started
as a process on one model with the same settings, warmed, measured, stopped.

`install_llama_server` builds the `llama-server` CMake target from the llama.cpp tree vendored in
the llama-cpp-python source package that `bench_serve_llama` already caches, with the CPU flags
its wheel is built with (native, AMX off: AMX crashes quantized models on this build), niced,
and keeps the binary in ~/.cache/doel/llama-server/<version>-<flags hash>/ (about 10 minutes on
2 cores the first time). Benchmarks call it only when asked (`--install-llama-server`); tests
and CI never build it.

`Server` starts either one with the load benchmark's settings (16 slots, 2,048 positions of
context a slot, 2 threads, the prefix cache on: doel-serve's per-tenant cache, llama-server's
slot cache and `--cache-ram`), and waits until it answers a real completion, not only /health:
llama-server has been seen dropping the first request sent right after /health turned 200.
`Server.sample_memory` samples the memory of its process tree with doel.contracts.memory (Linux):
Pss, what the system pays for it (a page shared with other processes counted by its share, not
whole), and the resident memory (RSS) beside it, the figure earlier results recorded; RSS alone
missed the pages a shared anonymous mapping keeps in shmem after giving them back (doel-serve's
KV cache did until issue 53), so the count of such mappings is recorded too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.serve.bench_serve_llama import CACHE, LLAMA_VERSION, NO_AMX, converter
from doel.contracts import memory

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # plain HTTP on localhost is all the benchmark needs
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI; this host has no such access
]
KEY = hashlib.sha256("\n".join(CMAKE_FLAGS).encode()).hexdigest()[:10]
HOME = CACHE / "llama-server" / f"{LLAMA_VERSION}-{KEY}"
BINARY = HOME / "llama-server"


def _cmake() -> str:
    """A cmake on PATH, else the one pip's `cmake` package put beside this interpreter."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if not found:
        raise SystemExit(
            "cmake is missing: install it (apt-get install cmake, or pip install cmake)"
        )
    return found


def install_llama_server(jobs: int = 2) -> Path:
    """Build llama-server once (cached by version and flags); returns the binary's path."""
    if BINARY.is_file():
        return BINARY
    src = converter().parent  # unpacks the cached source package if needed
    build = HOME / "build"
    nice = ["nice", "-n", "15"]
    print(f"building llama-server {LLAMA_VERSION} into {HOME} (about 10 min on 2 cores) ...")
    subprocess.run(nice + [_cmake(), "-S", str(src), "-B", str(build), *CMAKE_FLAGS], check=True)
    subprocess.run(
        nice + [_cmake(), "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
        check=True,
    )
    tmp = BINARY.with_suffix(".tmp")
    shutil.copy2(build / "bin" / "llama-server", tmp)
    os.replace(tmp, BINARY)  # atomic: a half-copied binary is never taken for a built one
    shutil.rmtree(build, ignore_errors=True)
    return BINARY


SLOTS = 16
CONTEXT = 2048  # positions a slot holds: the model's whole context, as doel-serve's slots do
THREADS = 2
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model: Path, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of `kind` ('doel' or 'llama') on `model` (a bundle, or a GGUF), with
    `extra` flags. Both get the same KV budget: SLOTS x CONTEXT positions (llama-server's -c,
    doel-serve's --kv-positions)."""
    if kind == "doel":
        return [sys.executable, "-m", "doel.serve", str(model), "--port", str(port),
                "--threads", str(THREADS), "--slots", str(SLOTS), "--max-queue", "256",
                "--kv-positions", str(SLOTS * CONTEXT), "--log-level", "warning",
                *extra]  # fmt: skip
    return [str(BINARY), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(THREADS), "-tb", str(THREADS), "-np", str(SLOTS),
            "-c", str(SLOTS * CONTEXT), "--cache-ram", "2048", "--no-webui",
            "--log-disable", *extra]  # fmt: skip


def _post(port: int, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# What a reading holds: MiB of Pss and of RSS, and shared anonymous mappings (a count).
KEYS = ("pss_mb", "rss_mb", "shmem_mappings")


def tree_mb(pid: int) -> dict[str, float]:
    """The memory of `pid` and every process below it (KEYS); 0 once it is gone."""
    m = memory.measure(pid, whole_tree=True)
    return {"pss_mb": m.pss_mb, "rss_mb": m.rss_mb, "shmem_mappings": len(m.shmem_mappings)}


class Peak:
    """The peak of each of KEYS, summed over some process trees, sampled every 0.2 s from its
    start until stop() (each its own peak: Pss and RSS need not peak at the same sample)."""

    def __init__(self, pids: list[int]):
        self.pids, self.mb, self._stop = pids, self.now(pids), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def now(pids: list[int]) -> dict[str, float]:
        got = [tree_mb(p) for p in pids]
        return {k: sum(g[k] for g in got) for k in KEYS}

    def _higher(self) -> dict[str, float]:
        now = self.now(self.pids)
        return {k: max(self.mb[k], now[k]) for k in KEYS}

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.mb = self._higher()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self._higher()


class Server:
    """One server process: started, ready (a real completion answered), sampled, stopped."""

    def __init__(self, kind: str, model: Path, log: Path, extra: tuple[str, ...] = ()):
        self.kind, self.port = kind, free_port()
        self.log = open(log, "ab")
        cmd = server_command(kind, model, self.port, extra)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._sampling: Peak | None = None

    def wait_ready(self, timeout: float = 300) -> None:
        """Until a 4-token completion comes back (two in a row: the first after /health has
        been seen lost)."""
        deadline, answered = time.monotonic() + timeout, 0
        while answered < 2:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"{self.kind} server exited ({self.proc.returncode}); see {self.log.name}"
                )
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.kind} server not ready after {timeout:.0f} s")
            try:
                _post(self.port, {"prompt": "আমি", "max_tokens": 4, "temperature": 0})
                answered += 1
            except (OSError, urllib.error.URLError, ValueError):
                answered = 0
                time.sleep(0.5)

    def sample_memory(self):
        """Start sampling the tree's memory (every 0.2 s) until stop_sampling()."""
        self._sampling = Peak([self.proc.pid])

    def stop_sampling(self) -> dict[str, float]:
        """The peaks since sample_memory() (Peak's KEYS)."""
        return self._sampling.stop()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
