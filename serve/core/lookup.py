"""Prompt-lookup drafts: the ids that followed the sequence's last few ids where they were seen
before, in its prompt or in what it has made, proposed for the model to verify in one run.

A reply that quotes, summarizes or rewrites its prompt (a passage, a JSON object, code) repeats
runs of it, and so does a reply that loops; there the model's next ids are often the ones that
followed the same n-gram earlier. `draft` finds the longest of the last NGRAM_MAX..NGRAM_MIN ids
that occurred earlier, its most recent occurrence, and returns up to `k` of the ids after it. No
model drafts: finding one costs a few microseconds over a context of thousands, and a sequence
with no match decodes as it would without drafting. llama-server's `--spec-type ngram-simple`
and Hugging Face's `prompt_lookup_num_tokens` draft the same way; how the step verifies a draft,
and when doel drafts at all, is in serve/core/step.py (`Steps._speculate`).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

NGRAM_MAX = 4  # the longest suffix looked up: longer ones rarely find more
NGRAM_MIN = 2  # a single id recurs everywhere (a space, a comma): its continuation is noise


def draft(context: np.ndarray, n: int, k: int) -> list[int]:
    """Up to `k` ids that followed the most recent earlier occurrence of the longest suffix of
    `context[:n]` (NGRAM_MAX down to NGRAM_MIN ids) that occurred before; none if none did."""
    if k < 1:
        return []
    ids = context[:n]
    for g in range(min(NGRAM_MAX, n - 1), NGRAM_MIN - 1, -1):
        # Windows that start at 0..n-g-1 end before the suffix's own position and have at
        # least one id after them.
        windows = sliding_window_view(ids[: n - 1], g)
        hits = np.flatnonzero((windows == ids[n - g :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + g
            return [int(i) for i in ids[start : min(start + k, n)]]
    return []
