"""Prefix caching: which token ids each slot's KV cache holds, so that a prompt starting with
them (the previous turn of a conversation, a shared system prompt) is not prefilled again.

With a shared KV buffer (`Bundle.share_buffer`) a slot's entries outlive the sequence that wrote
them: GroupQueryAttention writes a run's new entries at positions past..total-1 and reads only
the first `total`, so entry i stays the one token i produced until some run writes there again.
`Prefixes` is the only place that says which ids a slot holds. It is told after each engine run
has returned (`wrote`), never before, so a run that fails or a prefill abandoned half-way leaves
the claim at what was already in place; and a slot given to a new prompt keeps only the common
part (`assign`), since everything after it is about to be overwritten.

A slot's entries are reused only for a prompt of the partition that wrote them (its tenant and
cache salt: `tenants.partition`): a cached prefix tells whoever finds it what the text was, so
another partition's prompt sees the slot as holding nothing it can use.

The scheduler calls it from its worker thread and from the event loop, never both at once (the
loop waits for each step).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from doel.serve.edge.tenants import ONE

# A reuse shorter than this does not decide the slot: every prompt shares its BOS (and a few
# template tokens) with every cached one, and taking a slot for them would evict a conversation
# whose next turn needs it, to save a few tokens of prefill.
MIN_REUSE = 16
# An idle slot inside a batched step's span holding at least this many ids is parked outside it
# (Prefixes.parking): the copy costs about what one step's attention over the same ids does.
PARK_MIN = 64


@dataclass
class Hit:
    """Filled in at admission: how many of the prompt's tokens came from the cache."""

    tokens: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Prefixes:
    """The ids whose KV entries each slot holds, at positions 0..len-1."""

    def __init__(self, slots: int, context_length: int, enabled: bool = True):
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.owner: list[Hashable | None] = [ONE] * slots  # the partition that wrote each slot
        self.used = [0] * slots  # when each slot was last assigned (for least-recently-used)
        self.clock = 0
        self.context_length, self.enabled = context_length, enabled

    def assign(
        self,
        prompt: list[int],
        free: list[int],
        reuse: bool = True,
        busy: tuple[int, ...] = (),
        owner: Hashable | None = ONE,
    ) -> tuple[int, int]:
        """(slot, tokens reused) for `prompt` among the `free` slots, `busy` being those that
        run: the one with the longest common prefix when that reaches MIN_REUSE, else the one
        that keeps the running slots' span narrowest, and among those an empty slot (lowest
        first), else the least recently used. A batched step runs every slot of that span, an
        idle one as a placeholder row at a whole row's cost: new prompts given the emptiest
        slots anywhere spread 8 streams over 16 slots (benchmarks/results/serve_0.4b_cpu-*.md).
        At least the prompt's last token is fed again, for its logits. The slot keeps only the
        reused ids, and belongs to `owner` (the prompt's partition; None: reuse nothing) from
        now on: only its slots are searched."""
        best, k = None, 0
        if self.enabled and reuse and owner is not None:
            for s in free:
                if self.owner[s] != owner:
                    continue
                n = min(common_prefix(self.held[s], prompt), len(prompt) - 1)
                if n > k:
                    best, k = s, n
        if best is None or k < MIN_REUSE:

            def cost(s: int) -> tuple:
                span = max(s, *busy) - min(s, *busy) if busy else 0
                return span, bool(self.held[s]), self.used[s], s

            best, k = min(free, key=cost), 0
        self.clock += 1
        self.used[best] = self.clock
        self.owner[best] = owner
        del self.held[best][k:]
        return best, k

    def wrote(self, slot: int, start: int, ids: list[int]) -> None:
        """A run has written the entries of `ids` at positions start.. of `slot`. Claimed only
        if they continue what the slot holds (a gap would claim entries never written)."""
        if not self.enabled:
            return
        held = self.held[slot]
        if start <= len(held):
            del held[start:]
            held.extend(ids)

    def idle_total(self, slot: int) -> int:
        """The length to give an idle slot's placeholder row in a batched step: it writes one
        entry, at the position after what the slot holds, so nothing held is overwritten (a
        full slot gives up its last entry for it)."""
        held = self.held[slot]
        if len(held) >= self.context_length:
            del held[self.context_length - 1 :]
        return len(held) + 1

    def parking(self, slot: int, lo: int, top: int, busy: set[int]) -> int | None:
        """Where to move what idle `slot`, inside a batched step's span lo..top-1, holds: the
        free slot nearest the span outside it that holds nothing reusable (shorter than
        MIN_REUSE, so no conversation is evicted), or None. In the span its placeholder row
        attends over all it holds at every step, which slowed the streams around a held
        1,536-token conversation by a third (benchmarks/results/held_prefix_0.4b_cpu-*.md);
        parked, its conversation stays cached and its row attends over one entry."""
        if len(self.held[slot]) < PARK_MIN:
            return None
        spare = [
            s
            for s in range(len(self.held))
            if not lo <= s < top and s not in busy and len(self.held[s]) < MIN_REUSE
        ]
        return min(spare, key=lambda s: (lo - s if s < lo else s - top + 1, s), default=None)

    def moved(self, src: int, dst: int) -> None:
        """The engine copied what `src` holds to `dst`: the claim follows, `src` is empty."""
        self.held[dst], self.held[src] = self.held[src], []
        self.used[dst], self.owner[dst] = self.used[src], self.owner[src]

    def forget(self, slot: int) -> None:
        self.held[slot].clear()
