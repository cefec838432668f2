"""What a model card keeps of its evaluations: each held-out figure with the texts it comes
from (names and sha256), and earlier figures for other texts kept beside the new ones.

Issue 38: `doel-train eval CKPT --text other.txt` replaced the card's figures with whatever it
was given, naming nothing, so a card could show an outside text's bits/char as if it were the
held-out split's. A row is now identified by its language and its texts' hashes: the same
texts again replace their row, other texts add one; a task's row is replaced by its name.
Rows of cards written before texts were recorded (no "texts") give way to a new row of their
language.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from doel.train.data.textio import iter_documents

FIGURES = ("model", "twin", "compressors")


def text_source(path: str | Path) -> dict:
    """{"name", "sha256"} of a text: a file's bytes, or (a folder, a glob) its documents."""
    p, h = Path(path), hashlib.sha256()
    if p.is_file():
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        for doc in iter_documents(str(path)):
            h.update(doc.encode("utf-8") + b"\0")
    return {"name": p.name or str(path), "sha256": h.hexdigest()}


def _key(lang: str, texts: list[dict]) -> str:
    """The row's key in model_card.json: the language, then its texts' short hashes."""
    return " ".join([lang, *(t["sha256"][:12] for t in texts)])


def card_eval(result: dict | None) -> dict | None:
    """What the card shows of one evaluation: the figures and the texts' names and hashes, not
    the paths of the files (they differ from machine to machine)."""
    if not result:
        return None
    languages = {}
    for lang, r in (result.get("languages") or {}).items():
        texts = r.get("texts") or []
        row = {"language": r.get("language", lang), "texts": texts}
        languages[_key(row["language"], texts) if texts else lang] = row | {
            k: r[k] for k in FIGURES
        }
    tasks = {
        n: {k: v for k, v in r.items() if k != "path"}
        for n, r in (result.get("tasks") or {}).items()
    }
    return {"languages": languages, "tasks": tasks}


def merge(earlier: dict | None, new: dict | None) -> dict | None:
    """`new` (card_eval's form) over `earlier`: earlier rows for other texts and other tasks
    stay, in their order, before the new ones."""
    if not earlier:
        return new
    if not new:
        return earlier
    fresh = {r.get("language", k) for k, r in new["languages"].items()}
    kept = {
        k: r
        for k, r in (earlier.get("languages") or {}).items()
        if k not in new["languages"] and (r.get("texts") or r.get("language", k) not in fresh)
    }
    tasks = {k: r for k, r in (earlier.get("tasks") or {}).items() if k not in new["tasks"]}
    return {"languages": kept | new["languages"], "tasks": tasks | new["tasks"]}


def texts_cell(row: dict) -> str:
    """`bn.txt (sha256 1a2b3c4d5e6f)`, comma-separated: the card's column naming the texts."""
    texts = row.get("texts") or []
    if not texts:
        return "not recorded"
    return ", ".join(f"`{t['name']}` (sha256 {t['sha256'][:12]})" for t in texts)
