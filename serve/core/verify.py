"""Checking a bundle's files against the sha256 its manifest records (`files`, written by
doel-export) before they are served: a flipped byte in model.onnx.data would otherwise be served
as a different model, without a word.

Only the files serve reads are checked: the graph and its external data, the tokenizer and its
config (a bundle's model card or its browser page does not change an answer). Sizes first, at
no cost; then contents, hashed on threads of their own while the model loads (hashlib lets go
of the GIL), so a ready server has spent the longer of the load and the hashing rather than
their sum. Requests wait (503, "Loading") until both are done; a mismatch is one line naming
the file. A bundle written before doel recorded hashes is served unchecked. `doel-serve
--no-checksums` skips the check.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from doel.contracts.checksums import hash_files
from doel.serve.core.engine import Bundle, BundleError

READ = ("tokenizer.json", "tokenizer_config.json")  # besides the graph and its data
HINT = "export it again, or start with --no-checksums to serve it as it is"


class Damaged(BundleError):
    """A bundle file that is not what its manifest records; the message names it."""


def served_files(bundle: Bundle) -> list[str]:
    """The names of the files the manifest records that serve reads."""
    recorded = bundle.manifest.get("files")
    if not isinstance(recorded, dict):
        return []
    graph = bundle.model.name
    return sorted(n for n in recorded if n in READ or n == graph or n.startswith(graph + "."))


def check(bundle: Bundle) -> float:
    """Check the files serve reads against the manifest; the seconds it took. Raises Damaged
    (one line naming the file) at the first that differs."""
    start = time.perf_counter()
    recorded = bundle.manifest.get("files") or {}
    names = served_files(bundle)
    for name in names:
        path = bundle.folder / name
        want = recorded[name]
        if not isinstance(want, dict) or not isinstance(want.get("sha256"), str):
            raise Damaged(f"{bundle.folder / 'manifest.json'} has no sha256 for {name}; {HINT}")
        if not path.is_file():
            raise Damaged(f"{path} is missing; the manifest lists it; {HINT}")
        size = path.stat().st_size
        if size != want.get("bytes", size):
            raise Damaged(
                f"{path} is truncated or damaged: {size:,} bytes where the manifest records "
                f"{want['bytes']:,}; {HINT}"
            )
    for name, got in zip(names, hash_files([bundle.folder / n for n in names])):
        if got != recorded[name]["sha256"]:
            raise Damaged(
                f"{Path(bundle.folder) / name} does not match the sha256 its manifest records: "
                f"damaged since it was exported; {HINT}"
            )
    return time.perf_counter() - start


class Verification:
    """`check(bundle)` on a thread started at once, so that the model loads meanwhile; `wait`
    returns its seconds or raises its Damaged."""

    def __init__(self, bundle: Bundle):
        self.bundle, self.seconds = bundle, 0.0
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="doel-verify", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.seconds = check(self.bundle)
        except Exception as e:  # Damaged, or a file unreadable: given to whoever waits
            self.error = e

    def wait(self) -> float:
        self.thread.join()
        if isinstance(self.error, BundleError):
            raise self.error
        if self.error is not None:
            raise Damaged(f"cannot check {self.bundle.folder}: {self.error}; {HINT}")
        return self.seconds
