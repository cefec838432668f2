"""The "gguf" tokenizer style: doel's character-level BPE, re-spelled as a byte-level BPE that
llama.cpp runs id for id.

llama.cpp tokenizes a GGUF in one of two ways, and neither is doel's. Its SentencePiece path
escapes spaces to U+2581 and merges by score, not by merge rank; its BPE path splits text with
one of a fixed set of pre-tokenizer regexes (the `tokenizer.ggml.pre` name), spells every piece
as GPT-2's byte-level characters and applies merges by rank. So the "gguf" style:

1. splits with the regex of llama.cpp's `qwen35` pre-type, verbatim: GPT-4's split with
   combining marks (\\p{M}) in the letter class, so a Bengali word stays one piece (the other
   pre-types cut it at every vowel sign; doel's own split also keeps ZWJ/ZWNJ and one trailing
   danda in the word, which no pre-type does);
2. has no normalizer (llama.cpp has none: an NFC step would make the two disagree on text that
   is not NFC already);
3. is trained like doel's style, over characters with byte fallback, and then re-spelled: every
   token in byte-level characters, and in front of the learned merges the merges that build each
   alphabet character from its UTF-8 bytes (e0 a6 -> "e0a6", "e0a6" 95 -> "ক"). Those run first,
   so by the time a learned merge applies a word is the same character sequence the character-
   level BPE would start from, and both give the same tokens: the vocabulary keeps going to real
   units, as in the "doel" style, instead of to bytes inside characters (the cost of plain
   byte-level BPE: benchmarks/results/tokenizer.md). An unknown character stays bytes.

The byte prefixes ("e0a6") need ids; the last learned merges give theirs up, so the vocabulary
keeps the size asked.
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from doel.train.common import DoelError

# llama.cpp's qwen35 pre-type (src/llama-vocab.cpp keeps this tokenizer.json regex beside its
# own spelling, and runs a hand-written splitter for it). Changing one character here breaks the
# id-for-id match, which tests/export/test_gguf.py checks.
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b is spelled as this list's b-th character (printable
    Latin-1 bytes as themselves, the rest as the characters from U+0100 on, in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _spell(text: str, chars: list[str]) -> str:
    return "".join(chars[b] for b in text.encode("utf-8"))


def _byte_level_parts() -> dict:
    """tokenizer.json's pre_tokenizer and decoder for the style, as tokenizers writes them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    data = json.loads(tok.to_str())
    return {"pre_tokenizer": data["pre_tokenizer"], "decoder": data["decoder"]}


def respell_byte_level(data: dict, size: int) -> int:
    """Turn a trained character-level doel BPE (tokenizer.json as a dict, before padding) into
    the byte-level BPE that tokenizes every text into the same units, in place. Returns how many
    learned merges gave up their ids to the byte prefixes."""
    chars = byte_chars()
    model = data["model"]
    added = {a["content"] for a in data["added_tokens"]}
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]

    # The merges that build each multi-byte character of the alphabet, shortest prefix first.
    build: dict[int, dict[tuple[str, str], None]] = {}
    prefixes: dict[str, None] = {}
    for token, _ in by_id:
        if token in added or len(token) != 1:
            continue
        raw = token.encode("utf-8")
        for k in range(2, len(raw) + 1):
            left = "".join(chars[b] for b in raw[: k - 1])
            build.setdefault(k, {})[(left, chars[raw[k - 1]])] = None
            if k < len(raw):
                prefixes["".join(chars[b] for b in raw[:k])] = None
    # A one-byte character and its byte token are spelled alike: the byte token's id serves both.
    by_id = [(t, i) for t, i in by_id if t in added or len(t.encode("utf-8")) > 1 or len(t) != 1]
    over = len(by_id) + len(prefixes) - size
    dropped = max(0, over)
    if dropped > len(merges):
        raise DoelError(
            f"vocab_size={size} leaves no room for the {len(prefixes)} byte prefixes the "
            f"'gguf' style needs beside the corpus's characters; choose at least {size + over}"
        )
    gone = {a + b for a, b in merges[len(merges) - dropped :]}
    kept = [t for t, _ in by_id if t not in gone]

    def spelled(token: str) -> str:
        if token in added:
            return token
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return chars[int(token[3:5], 16)]
        return _spell(token, chars)

    vocab = {spelled(t): i for i, t in enumerate(kept)}
    for p in prefixes:
        vocab[p] = len(vocab)
    learned = [(_spell(a, chars), _spell(b, chars)) for a, b in merges[: len(merges) - dropped]]
    char_merges = [m for k in sorted(build) for m in build[k]]
    data["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [list(m) for m in char_merges + learned],
    }
    for a in data["added_tokens"]:
        a["id"] = vocab[a["content"]]
    post = data.get("post_processor") or {}
    for spec in post.get("special_tokens", {}).values():
        spec["ids"] = [vocab[t] for t in spec["tokens"]]
    data["normalizer"] = None
    data.update(_byte_level_parts())
    return dropped
