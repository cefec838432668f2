"""The adapted model's tokenizer: the base's own, extended with Bangla tokens learned over the
base's own tokens, so that every id the base had keeps its meaning.

How a vocabulary is extended (`extend`): the Bangla text is split into words by a pre-tokenizer,
each word is cut into the base's tokens (the base's BPE, exactly as it encodes), and new merges
are learned over those tokens, most frequent pair first (byte-pair encoding, Sennrich et al.
2016, run on the base's segmentation instead of on bytes). The new merges go after the base's:
BPE applies the lowest rank first, so a word is first encoded exactly as the base encodes it and
only then are the new merges applied, and text without Bangla (every pair a new merge joins is a
pair of Bangla pieces) keeps the base's ids. New tokens take the ids after the base's last.

Two pre-tokenizers are offered, and benchmarks/results/adapt_*.md measures both:

- "base": the base's own split, unchanged. Every runtime that runs the base's tokenizer runs
  the extended one (a GGUF names the same pre-type), but a GPT-2-style split cuts a Bangla word
  at every vowel sign and virama (they are \\p{M}, outside \\p{L}), so no merge can join across
  them and the characters per token stay low.
- "marks": the base's split with the combining marks put into the letter class (`[\\p{L}\\p{M}]`
  where the base has `\\p{L}`), so a Bangla word is one piece. Text without marks splits as
  before; a runtime with its own hand-written splitter (llama.cpp) does not know this regex.
- "qwen35": the split of llama.cpp's qwen35 pre-type (train/data/bytelevel.py's, which doel's
  GGUF export names): marks in the word as "marks" has them, and a split llama.cpp runs; it
  differs from a GPT-2-style split around punctuation, which the base's merges rarely cross.

The third choice, replacing the tokenizer with doel's `spm` one, needs no code here: it is
`doel-train tokenizer` (train/data/tokenizer.py) and the transplant of embeddings (init.py).
"""

from __future__ import annotations

import copy
import json
import unicodedata
from collections import Counter
from collections.abc import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from doel.train.common import DoelError
from doel.train.data.bytelevel import _byte_level_parts

SPLITS = ("base", "marks", "qwen35")
FIRST_PRIVATE = 0xF0000  # Supplementary Private Use Area-A: one character a base token
# the split ByteLevel(use_regex=True) runs (GPT-2's), written out
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LETTERS = (r"\p{L}+", r"[\p{L}\p{M}]+")
_OTHERS = (r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]")


def marks_kept(pre: dict) -> dict:
    """The base's pre-tokenizer with \\p{M} beside \\p{L} in each split regex; refused when
    the base's split has no `\\p{L}+` to widen (not a GPT-2-style split). A ByteLevel step
    that splits by its own (GPT-2's) regex gets that regex as a Split step before it."""
    out, changed = _explicit_regex(copy.deepcopy(pre)), 0
    for step in out.get("pretokenizers", [out]):
        pattern = step.get("pattern", {}) if step.get("type") == "Split" else {}
        regex = pattern.get("Regex")
        if regex and _LETTERS[0] in regex:
            pattern["Regex"] = regex.replace(*_LETTERS).replace(*_OTHERS)
            changed += 1
    if not changed:
        raise DoelError(
            "the base's pre-tokenizer has no \\p{L}+ split to widen with the marks; "
            "use split=base, or replace the tokenizer (tokenizer=spm)"
        )
    return out


def _explicit_regex(pre: dict) -> dict:
    steps = pre.get("pretokenizers", [pre]) if pre else []
    for k, step in enumerate(steps):
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            split = {"type": "Split", "pattern": {"Regex": GPT2}, "behavior": "Isolated"}
            steps[k : k + 1] = [split | {"invert": False}, step | {"use_regex": False}]
            return pre if "pretokenizers" in pre else {"type": "Sequence", "pretokenizers": steps}
    return pre


def pre_tokenizer(data: dict, split: str) -> dict:
    """The pre_tokenizer of the `split` choice for a base tokenizer.json `data`."""
    if split == "qwen35":  # llama.cpp's pre-type, as doel's gguf style writes it
        return _byte_level_parts()["pre_tokenizer"]
    return data["pre_tokenizer"] if split == "base" else marks_kept(data["pre_tokenizer"])


def _byte_level_words(data: dict, split: str, texts: Iterable[str]) -> Counter:
    """How often each pre-tokenized word (in the base's byte-level spelling) occurs."""
    pre = pre_tokenizer(data, split)
    splitter = Tokenizer.from_str(json.dumps(data | {"pre_tokenizer": pre})).pre_tokenizer
    words: Counter = Counter()
    for text in texts:
        text = unicodedata.normalize("NFC", text)
        words.update(w for w, _ in splitter.pre_tokenize_str(text) if _has_bengali(w))
    return words


def _has_bengali(word: str) -> bool:
    # UTF-8 of U+0980..U+09FF starts with e0 a6 / e0 a7: "à¦" / "à§" in byte-level letters
    return "à¦" in word or "à§" in word


def learn_merges(base: Tokenizer, words: Counter, n_new: int, min_frequency: int = 2):
    """Up to `n_new` merges over the base's tokens of `words`, as (left, right) strings in the
    base's byte-level spelling, most frequent first. The BPE counting is the tokenizers
    library's: each base token is spelled as one private-use character, so its trainer learns
    merges of base tokens."""
    char_of: dict[str, str] = {}
    lines = []
    for word, n in words.items():
        pieces = [t.value for t in base.model.tokenize(word)]
        spelled = "".join(char_of.setdefault(p, chr(FIRST_PRIVATE + len(char_of))) for p in pieces)
        if len(pieces) > 1:
            lines.append((spelled, n))
    if not lines:
        return []
    token_of = {c: p for p, c in char_of.items()}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=len(char_of) + n_new,
        min_frequency=min_frequency,
        initial_alphabet=list(token_of),
        limit_alphabet=len(token_of),
        show_progress=False,
        special_tokens=[],
    )
    bpe.train_from_iterator((" ".join([w] * n) for w, n in lines), trainer)
    merges = json.loads(bpe.to_str())["model"]["merges"]
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    return [("".join(map(token_of.get, a)), "".join(map(token_of.get, b))) for a, b in pairs]


def extend(base_json: dict, texts: Iterable[str], n_new: int, split: str = "base") -> dict:
    """The base's tokenizer.json extended by up to `n_new` tokens learned on `texts` (Bangla)
    with the `split` pre-tokenizer ("base" or "marks"); the base's ids unchanged."""
    if split not in SPLITS:
        raise DoelError(f"split={split!r}: choose one of {list(SPLITS)}")
    model = base_json.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(base_json):
        raise DoelError(
            "the base's tokenizer is not a byte-level BPE; extending it is not supported, "
            "replace it instead (tokenizer=spm)"
        )
    base = Tokenizer.from_str(json.dumps(base_json))
    words = _byte_level_words(base_json, split, texts)
    out = copy.deepcopy(base_json)
    vocab, merges = out["model"]["vocab"], out["model"]["merges"]
    as_text = bool(merges) and isinstance(merges[0], str)
    have = {tuple(m.split(" ", 1)) if as_text else tuple(m) for m in merges}
    size = max(base.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    added = 0
    for left, right in learn_merges(base, words, n_new):
        if added >= n_new:
            break
        if (left, right) in have:
            continue
        have.add((left, right))
        merges.append(f"{left} {right}" if as_text else [left, right])
        if left + right not in vocab:
            vocab[left + right] = size + added
            added += 1
    out["pre_tokenizer"] = pre_tokenizer(base_json, split)
    return out


def _is_byte_level(data: dict) -> bool:
    text = json.dumps(data.get("pre_tokenizer"))
    return '"ByteLevel"' in text


def new_token_ids(base_json: dict, adapted_json: dict) -> list[int]:
    """The ids of the adapted vocabulary that the base lacks, in order."""
    old = set((base_json["model"].get("vocab") or {}).values())
    old |= {a["id"] for a in base_json.get("added_tokens") or []}
    return sorted(set(adapted_json["model"]["vocab"].values()) - old)
