"""What doel-train's command line says when a name is wrong: a misspelt flag or --set key gets
the closest name ("did you mean"), and a folder passed as a tokenizer is read as the
tokenizer.json inside it.

argparse by default takes any unambiguous prefix of a flag, so `--txt` is not an error of its
own: it is reported as a missing `--text` (issue 38). `allow_abbrev=False` makes every flag
whole, and `error` names the unknown flag with its closest match before argparse's own message.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

# Names other trainers use for doel's config keys: difflib alone cannot see that
# learning_rate is lr (too few letters in common).
ALIASES = {
    "learning_rate": "lr",
    "max_lr": "lr",
    "max_steps": "steps",
    "num_steps": "steps",
    "train_steps": "steps",
    "block_size": "seq_len",
    "context_length": "seq_len",
    "max_seq_len": "seq_len",
    "seq_length": "seq_len",
    "micro_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "warmup": "warmup_steps",
    "wd": "weight_decay",
}


def closest(name: str, known: list[str]) -> str | None:
    """The known name `name` most likely meant: a common alias, else difflib's closest match."""
    if ALIASES.get(name) in known:
        return ALIASES[name]
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return match[0] if match else None


def did_you_mean(name: str, known: list[str], quote: str = "`") -> str:
    """`; did you mean `lr`?` or nothing."""
    guess = closest(name, known)
    return f"; did you mean {quote}{guess}{quote}?" if guess else ""


def tokenizer_path(value: str) -> str:
    """An argparse type: a folder holding tokenizer.json stands for that file (a model or
    tokenizer folder, as `doel-train tokenizer` and fit write them)."""
    path = Path(value)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return str(path / "tokenizer.json")
    return value


class Parser(argparse.ArgumentParser):
    """ArgumentParser with whole flags only, and unknown flags named with a suggestion.
    Subparsers made with add_parser are of this class too (argparse uses the parent's)."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)
        self._seen: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._seen = list(sys.argv[1:] if args is None else args)
        ns, extras = super().parse_known_args(args, namespace)
        if any(self._flags(extras)):  # here, where the command's own flags are known
            self.error("unrecognized arguments: " + " ".join(extras))
        return ns, extras

    def _flags(self, args: list[str]) -> list[str]:
        """The --flags among `args` that this parser does not know."""
        flags = [a.split("=", 1)[0] for a in args if a.startswith("--") and a != "--"]
        return [f for f in flags if f not in self._option_string_actions]

    def error(self, message: str):
        options = sorted(o for o in self._option_string_actions if o.startswith("--"))
        notes = [
            f"unknown option {f}{did_you_mean(f, options, '')}" for f in self._flags(self._seen)
        ]
        super().error("; ".join([*notes, message]) if notes else message)
