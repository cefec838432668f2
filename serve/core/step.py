"""One step of the continuous batch, on the engine thread: what `Scheduler` runs between its
admissions.

A step advances every sequence whose ids are in its slot's cache by one token in one batched run
(the weights are read once for all of them; a lone one by a verified draft instead, `_speculate`),
then feeds prompt chunks of the filling ones, oldest first, within the step's token budget
(`step_tokens`), and samples. A failure is the failing part's: a batched run that fails ends the
rows it ran, a chunk that fails ends its own sequence, and a grammar in error ends its row; the
other sequences of the step carry on, since their entries and ids are intact (issue 53, item 3).
A sequence that was preempted refills its slot with the ids it had (`Seq.target`) and then decodes
on where it stopped, sampling nothing in between: its stream goes on as if nothing happened.
"""

from __future__ import annotations

import logging

import numpy as np

from doel.serve.core.logprobs import Scored, score_rows
from doel.serve.core.lookup import draft
from doel.serve.core.sampling import sample
from doel.serve.core.structured import Constraint, DeadEnd, fill_all

# The smallest prompt chunk a step takes beside decoding rows: below it, the weights read for a
# chunk cost more than its tokens (prefill times by chunk: benchmarks/results/profile_serve_*).
MIN_CHUNK = 8
log = logging.getLogger("doel.serve")


class StepFailed(RuntimeError):
    """A sequence's part of a step failed; the message says which part and why."""


class Steps:
    """The step of `Scheduler` (engine, prefixes, step_tokens and park are its)."""

    def _step(self, stepping: list) -> list[tuple]:
        """One batched step of the decoding sequences, then prompt chunks of the filling ones in
        admission order within the step's budget; sample. Chunks of prompts that arrive
        together run one after another, not batched: it saves little of their prefill and
        would hold back the first one's first token. (sequence, id, None or an error, finished)
        for each sequence that moved."""
        events = []
        decoding = [s for s in stepping if not s.filling]
        self.step_ids = len(decoding)  # ids the decoding rows feed (a verified draft's more)
        if decoding:
            try:
                events += self._decode(stepping, decoding)
            except Exception as e:  # these rows end; the prompts below still go in
                log.exception("engine step failed")
                events += [(s, StepFailed(f"the engine failed: {e}"), True) for s in decoding]
        # Prompt chunks, oldest prompt first, within what the decoding rows left of the step's
        # budget: a lone prompt gets a whole chunk; prompts that wait together share a step.
        budget = self.step_tokens - self.step_ids
        for i, s in enumerate(x for x in stepping if x.filling):
            if i and budget < MIN_CHUNK:
                break
            size = min(self.engine.prefill_chunk, max(MIN_CHUNK, budget))
            if not decoding and not i:
                size = self.engine.prefill_chunk
            try:
                budget -= self._fill(s, size, events)
            except Exception as e:
                log.exception("prompt chunk failed")
                events.append((s, StepFailed(f"the engine failed: {e}"), True))
        return events

    def _decode(self, stepping: list, decoding: list) -> list[tuple]:
        """The batched run of the decoding rows, and their picks (or a lone row's draft
        verified: `_speculate`)."""
        if len(decoding) == 1 and self.draft_tokens and decoding[0].constraint is None:
            events = self._speculate(decoding[0])
            if events is not None:
                return events
        # One run covers the slots from the lowest decoding one to the highest: a lone
        # stream in slot 2 is one row, not three (each row costs its share of attention,
        # over a held prefix too: benchmarks/results/profile_serve_0.4b_cpu-*.md).
        lo = min(s.slot for s in decoding)
        top = max(s.slot for s in decoding) + 1
        self._park(lo, top, {s.slot for s in stepping})
        # Other slots in between take a placeholder row. It writes one cache entry, past
        # what the slot holds: after an idle slot's cached prefix, or at the next position
        # of a filling one, which that prompt's next chunk overwrites before anything reads.
        tokens = [0] * (top - lo)
        totals = [self.prefixes.idle_total(i) for i in range(lo, top)]
        for s in stepping:
            if lo <= s.slot < top:
                tokens[s.slot - lo] = int(s.context[s.n - 1]) if not s.filling else 0
                totals[s.slot - lo] = s.n if not s.filling else s.fed + 1
        # The grammar rows' masks are computed on a thread of their own while the model
        # runs (llguidance lets go of the GIL); rows without a format add nothing.
        constrained = [s for s in decoding if s.constraint is not None]
        masks = fill_all([s.constraint for s in constrained]) if constrained else None
        logits = self.engine.decode(tokens, totals, lo)
        if masks is not None:
            masks.result()
            for s in constrained:
                s.masked = True
        for s in decoding:
            self.prefixes.wrote(s.slot, s.n - 1, [int(s.context[s.n - 1])])
        return [self._pick(s, logits[s.slot - lo]) for s in decoding]

    def _speculate(self, s) -> list[tuple] | None:
        """A lone decoding sequence's prompt-lookup draft (serve/core/lookup.py) verified in
        one run over its slot, or None where it has none: the run feeds its last id and the
        draft, and each position's logits are picked in turn as a step would pick them (the
        same sampling, the same draws of its generator), until a pick differs from the draft.
        So greedy output is the one a step at a time would make, and a sampled one has the
        distribution it would have: an id is kept only where the model itself picked it. The
        entries of the ids not kept lie past what the slot holds, and are never read. Only a
        lone row drafts: ONNX Runtime's GroupQueryAttention takes several ids after a cache
        for one sequence a run, so verifying several rows would give up the batched step
        (benchmarks/results/verify_*, spec_*)."""
        room = self.kv_positions - self._used() - self._idle_held()  # the pool's free positions
        left = s.params.max_tokens - s.made - 1  # the last position's pick is one more
        budget = self.step_tokens - 1  # the step's ids (step_tokens): the last one and a draft
        k = min(self.draft_tokens, self.engine.context_length - s.n, room, left, budget)
        proposed = draft(s.context, s.n, k)
        if not proposed:
            return None
        fed = s.n - 1
        last = int(s.context[fed])
        self.step_ids = 1 + len(proposed)
        logits = self.engine.forward([last, *proposed], fed, slot=s.slot, every=True)
        self.drafted += len(proposed)
        events, kept = [], 0
        for j, row in enumerate(logits):
            event = self._pick(s, row)
            events.append(event)
            if event[2] or j == len(proposed) or event[1] != proposed[j]:
                break
            kept += 1
        self.accepted += kept
        self.prefixes.wrote(s.slot, fed, [last, *proposed[:kept]])
        return events

    def _fill(self, s, size: int, events: list) -> int:
        """The next `size` ids of `s` that its slot lacks (`Seq.target`), and once they are in,
        its first new id (none for a preempted sequence refilled: its next id is known); the
        number of ids fed."""
        chunk = [int(i) for i in s.context[s.fed : min(s.fed + size, s.target)]]
        scored = s.record is not None and s.record.prompt and not s.made
        logits = self.engine.forward(chunk, s.fed, slot=s.slot, every=scored)
        self.prefixes.wrote(s.slot, s.fed, chunk)
        if scored:
            # Row r predicts prompt token fed + r + 1; the last row of the last chunk
            # predicts the first new token instead (scored when it is picked).
            if s.fed == 0:
                s.record.entries.append(None)  # the first token has no context
            targets = s.prompt[s.fed + 1 : s.fed + len(chunk) + 1]
            s.record.entries += score_rows(logits, targets, s.record.top)
            logits = logits[-1]
        s.fed += len(chunk)
        if not s.filling and not s.made:
            if s.params.max_tokens == 0:  # the prompt scored, nothing to generate
                events.append((s, None, True))
            else:
                events.append(self._pick(s, logits))
        return len(chunk)

    def _park(self, lo: int, top: int, busy: set[int]) -> None:
        """On the engine thread, before a step of slots lo..top-1: move what idle slots among
        them hold to free slots outside (`Prefixes` says where, and when it pays), so
        their placeholder rows attend over one entry, not over a held conversation. Only the
        worker writes the cache, and no admission happens during a step."""
        if not self.park:
            return
        for slot in range(lo, top):
            if slot in busy:
                continue
            dst = self.prefixes.parking(slot, lo, top, busy)
            if dst is not None:
                self.engine.copy_slot(slot, dst, len(self.prefixes.held[slot]))
                self.prefixes.moved(slot, dst)
                self.engine.release(slot, 0)
                if slot in self.idle_since:
                    self.idle_since[dst] = self.idle_since.pop(slot)

    def _pick(self, s, logits: np.ndarray) -> tuple:
        """Sample the next id; (sequence, id or None at a stop id, finished)."""
        p, c = s.params, s.constraint
        if c is not None:
            try:
                return self._pick_constrained(s, c, logits)
            except DeadEnd as e:  # the grammar ends here unfinished: "length", as a cut would
                log.warning("grammar dead end, the request ends unfinished: %s", e)
                return s, None, True
            except RuntimeError as e:  # a matcher in error: this sequence fails, not the step
                log.error("grammar failed: %s", e)
                return s, StepFailed(f"structured output failed: {e}"), True
        token = sample(logits, p, s.rng, s.context[: s.n], s.context[len(s.prompt) : s.n])
        if token in p.stop_token_ids:
            return s, None, True
        return self._took(s, token, logits)

    def _pick_constrained(self, s, c: Constraint, logits: np.ndarray):
        """`_pick` of a row with a grammar: its logits masked to the tokens the grammar
        allows (the stop ids only where it accepts), and the sequence ended where it ends."""
        p = s.params
        if not s.masked:  # the first token, after the prompt's last chunk
            c.fill()
        s.masked = False
        logits = c.mask(logits, p.stop_token_ids)
        token = sample(logits, p, s.rng, s.context[: s.n], s.context[len(s.prompt) : s.n])
        if token in p.stop_token_ids:
            c.advance(None)
            return s, None, True
        c.advance(token)
        s, token, full = self._took(s, token, logits)
        if s.record is not None:  # tokens the grammar forbids are no alternatives (-inf)
            last = s.record.entries[-1]
            keep = [k for k, v in enumerate(last.top_logprobs) if v != -np.inf]
            ids = tuple(last.top_ids[k] for k in keep)
            values = tuple(last.top_logprobs[k] for k in keep)
            s.record.entries[-1] = Scored(last.logprob, ids, values)
        return s, token, full or c.done

    def _took(self, s, token: int, logits: np.ndarray) -> tuple:
        """Record a picked id; finished when max_tokens or the context is reached."""
        p = s.params
        if s.record is not None:
            s.record.entries += score_rows(logits, [token], s.record.top)
        s.context[s.n] = token
        s.n += 1
        return s, token, s.made >= p.max_tokens or s.n >= self.engine.context_length
