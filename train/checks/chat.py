"""The chat fine-tuning check: the loss mask covers exactly the assistant spans.

It does not trust the renderer that made the mask (train/data/chat.py): it finds the spans
again from the inputs alone. A position is the assistant's when the last turn marker before it
is <|assistant|>: the reply's content and the <|end|> that closes it. Then, in every row the
loader serves, a target must be set exactly there, and equal the next input token (the label
shift); one <|bos|>, at the start, and no pad before a real token, so a row holds one whole
conversation and nothing attends across two. A mask that lets a user's, system's or marker's
token into the loss (or drops a reply's) is reported with the row and position of the first.
"""

from __future__ import annotations

import numpy as np

from doel.train.checks.base import CheckResult

IGNORE = -100


def expected_mask(x: np.ndarray, special: dict) -> np.ndarray:
    """(B, T) inputs → (B, T) bool: target t (the token at position t + 1) is the assistant's."""
    markers = {special[k]: k for k in ("system", "user", "assistant", "end")}
    out = np.zeros(x.shape, dtype=bool)
    for b, row in enumerate(x):
        inside = False  # the last marker at or before t is <|assistant|>
        for t, tok in enumerate(row):
            kind = markers.get(int(tok))
            if kind == "assistant":
                inside = True
            elif kind is not None or tok == special["pad"]:
                inside = False
            out[b, t] = inside
    return out


KINDS = {
    "extra": "a target outside the assistant's spans (system, user or marker text in the loss)",
    "missing": "an assistant token without a target",
    "shift": "a target that is not the next input token",
    "bos": "a row that does not hold exactly one conversation (<|bos|> not first, or again)",
    "pad": "a real token after a pad",
}


def mask_problems(x: np.ndarray, y: np.ndarray, special: dict) -> tuple[dict, dict]:
    """One batch's problems, {kind: (count, (row, position) of the first)}, and its counts."""
    want = expected_mask(x, special)
    got = y != IGNORE
    pad = x == special["pad"]
    bos = x == special["bos"]
    bos[:, 0] = ~bos[:, 0]  # a row must open with <|bos|> and hold no other
    found = {
        "extra": got & ~want,
        "missing": want & ~got,
        # A target is the next input (the loader keeps a conversation's last token as input).
        "shift": np.pad(got[:, :-1] & (y[:, :-1] != x[:, 1:]), ((0, 0), (0, 1))),
        "bos": bos,
        "pad": np.pad(pad[:, :-1] & ~pad[:, 1:], ((0, 0), (0, 1))),
    }
    problems = {}
    for kind, where in found.items():
        at = np.argwhere(where)
        if len(at):
            problems[kind] = (len(at), tuple(int(i) for i in at[0]))
    return problems, {"targets": int(got.sum()), "assistant_tokens": int(want.sum())}


def check_loss_mask(s, batches: int = 4) -> CheckResult:
    """The run's next `batches` batches (peeked, not consumed)."""
    checked = (
        "in the batches the run will train on, the loss is taken exactly on the assistant's "
        "tokens (content and closing <|end|>, found from the turn markers), each target is "
        "the next token, and a row holds one conversation"
    )
    special = getattr(s.loader, "special", None)
    if special is None:
        return CheckResult("loss_mask", checked, None, {}, "not a chat run")
    totals = {"rows": 0, "targets": 0, "assistant_tokens": 0}
    problems: dict[str, list] = {}
    for i, (x, y) in enumerate(s.loader.peek(batches)):
        found, counts = mask_problems(np.asarray(x), np.asarray(y), special)
        for kind, (n, (b, t)) in found.items():
            seen = problems.setdefault(kind, [0, f"batch {i}, row {b}, position {t}"])
            seen[0] += n
        totals["rows"] += len(x)
        for k, v in counts.items():
            totals[k] += v
    totals |= {f"{kind}_problems": n for kind, (n, _) in problems.items()}
    detail = "; ".join(f"{n:,} × {KINDS[k]} (first: {at})" for k, (n, at) in problems.items())
    detail = detail or (
        f"{totals['targets']:,} targets, all on the assistant's {totals['assistant_tokens']:,} "
        f"tokens, in {totals['rows']} rows"
    )
    return CheckResult("loss_mask", checked, not problems, totals, detail)
