"""A run's next step of micro-batches, read and on its way to the device while the current step
computes: `Prefetcher`.

On CUDA each batch goes through page-locked (pinned) host memory and is copied with
`non_blocking=True`, so the copy is queued on the stream behind the step's kernels and the host
goes on to read the next step; a copy from pageable memory instead waits until the GPU is done
(it drains the queue) once a step. Pinned blocks come from torch's caching host allocator, which
keeps each until the copy out of it finished. On the CPU the batches are the loader's arrays.

The loader runs one step ahead, so its own position is not where a resumed run must continue:
`state_dict` is the loader's state before the prefetched step (the one a checkpoint keeps).
"""

from __future__ import annotations

import torch


def to_device(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) numpy arrays as tensors on the device; through pinned memory and a
    non-blocking copy on CUDA."""
    x, y = (torch.from_numpy(a) for a in batch)
    if device.type != "cuda":
        return x.to(device), y.to(device)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in (x, y))


class Prefetcher:
    """`next()` gives a step's `n` micro-batches on the device; `prefetch()` (called once the
    step's work is queued) reads and sends the following step's; `state_dict()` is the loader's
    state as if nothing had been read ahead."""

    def __init__(self, loader, device: torch.device, n: int):
        self.loader, self.device, self.n = loader, device, n
        self._ahead = None  # (the loader's state before these batches, the batches)

    def _read(self):
        state = self.loader.state_dict()
        batches = [to_device(self.loader.next_batch(), self.device) for _ in range(self.n)]
        return state, batches

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ahead, self._ahead = self._ahead or self._read(), None
        return ahead[1]

    def prefetch(self) -> None:
        if self._ahead is None:
            self._ahead = self._read()

    def state_dict(self) -> dict:
        return self._ahead[0] if self._ahead is not None else self.loader.state_dict()
