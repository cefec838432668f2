"""The "spm" tokenizer style: SentencePiece BPE, written as a tokenizer.json that llama.cpp's own
SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`) runs id for id.

Why this style exists: llama.cpp runs no tokenizer.json. Its BPE path splits text with one of a
fixed set of regexes first, and none of them is doel's split (the cost of the "gguf" style:
benchmarks/results/gguf.md). Its SentencePiece path splits nothing: spaces become U+2581 ("▁"),
the text is spelled in characters and pairs merge by the score of the piece they make, the
highest first; a character the vocabulary lacks becomes its <0xNN> byte tokens. No regex cuts a
Bengali word at its vowel signs, so nothing is lost to the split.

Trained by the `sentencepiece` library (model_type bpe) with the settings under which llama.cpp
matches it: no normalization (identity: llama.cpp normalizes nothing), a "▁" in front of the
text, whitespace kept as it is, byte fallback, digits one a token (as doel and llama.cpp's
pre-types split them into short groups, so numbers do not eat the vocabulary).

Written in the form transformers calls "legacy" for Llama 2's tokenizer: a normalizer that puts
"▁" in front and turns every space into "▁", no pre-tokenizer, BPE over characters with byte
fallback whose merges are every split of every piece into two pieces, ranked by the score of the
piece they make (SentencePiece's and llama.cpp's order), and a decoder that undoes the spaces.
The form without the normalizer (a Metaspace pre-tokenizer) differs from llama.cpp on text that
starts with a space. decode(encode(s)) == s, except that a literal "▁" in s decodes as a space.

The ids keep doel's layout: the special tokens first, then the 256 byte tokens, then the pieces
by score (best first), so every other stage reads this tokenizer as it reads the others.
"""

from __future__ import annotations

import io
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator

import sentencepiece

SPACE = "\u2581"  # SentencePiece's space: "▁"


def spm_options(vocab_size: int, max_token_length: int, max_doc_chars: int) -> dict:
    """The SentencePiece trainer's settings (the names its TrainerSpec gives them)."""
    return {
        "model_type": "bpe",
        "vocab_size": vocab_size,
        "byte_fallback": True,
        "split_digits": True,
        "normalization_rule_name": "identity",
        "add_dummy_prefix": True,
        "remove_extra_whitespaces": False,
        "allow_whitespace_only_pieces": True,
        # A word and the danda after it are different Unicode scripts: kept apart, "গেল।"
        # could never be one piece (doel's split keeps one trailing mark in the word).
        "split_by_unicode_script": False,
        "max_sentencepiece_length": max_token_length,
        # A document is one "sentence", newlines inside; its bytes, at most 4 a character.
        "max_sentence_length": 4 * max_doc_chars + 16,
        "character_coverage": 0.9999,  # rarer characters are spelled with byte tokens
        "unk_id": 0,
        # The trainer never merges text that spells its unknown piece, "<unk>" by default (and
        # Wikipedia dumps spell it often); ours is dropped from the vocabulary, so any name
        # that no text spells will do.
        "unk_piece": "<|spm_unknown|>",
        "bos_id": -1,
        "eos_id": -1,
        "pad_id": -1,
        "num_threads": os.cpu_count() or 1,
        "minloglevel": 2,
    }


def train_spm(
    texts: Iterable[str],
    vocab_size: int,
    specials: list[str],
    byte_tokens: list[str],
    alphabet: list[str],
    max_token_length: int,
    max_doc_chars: int,
) -> dict:
    """Train on `texts` and return the tokenizer.json (as a dict) holding `specials` at ids
    0.., the byte tokens after them and the learned pieces after those, at most vocab_size in
    all (fewer when the corpus runs out of pieces: the caller pads)."""
    # The trainer's size counts its own unknown piece and the 256 byte pieces; ours replaces
    # the unknown piece (byte fallback never needs it) with the special tokens.
    sp_size = vocab_size - len(specials) + 1
    required = "".join(sorted({SPACE if c == " " else c for c in alphabet}))
    options = spm_options(sp_size, max_token_length, max_doc_chars)
    texts = list(_nonempty(texts))  # read once: a corpus short of pieces is trained again
    try:
        model = _train(texts, required, options)
    except RuntimeError as e:
        fewer = re.search(r"value <= (\d+)", str(e))
        if fewer is None:
            raise
        # The corpus has fewer pieces than asked: train the most it has (the caller pads).
        model = _train(texts, required, options | {"vocab_size": int(fewer.group(1))})
    proc = sentencepiece.SentencePieceProcessor(model_proto=model)
    return tokenizer_json(proc, specials, byte_tokens)


def _train(texts: list[str], required: str, options: dict) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, required_chars=required, **options
    )
    return model.getvalue()


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if t:
            yield t


def tokenizer_json(proc, specials: list[str], byte_tokens: list[str]) -> dict:
    """The legacy-Llama tokenizer.json of a trained SentencePiece BPE model."""
    pieces = [
        proc.id_to_piece(i)
        for i in range(proc.get_piece_size())
        if not (proc.is_unknown(i) or proc.is_control(i) or proc.is_byte(i) or proc.is_unused(i))
    ]
    found = [proc.id_to_piece(i) for i in range(proc.get_piece_size()) if proc.is_byte(i)]
    if found != byte_tokens:
        raise AssertionError(f"SentencePiece made {len(found)} byte pieces, not the 256 expected")
    vocab = {t: i for i, t in enumerate([*specials, *byte_tokens, *pieces])}
    if len(vocab) != len(specials) + len(byte_tokens) + len(pieces):
        raise AssertionError("a SentencePiece piece spells a special or byte token")
    added = [
        {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t in specials
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": None,  # the caller's: <|bos|> in front
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges(pieces, vocab),
        },
    }


def merges(pieces: list[str], vocab: dict[str, int]) -> list[list[str]]:
    """Every (left, right) pair of pieces that makes a piece, ranked by the piece made (a lower
    id is a higher score, the order SentencePiece and llama.cpp merge in), then by the left
    piece's id. llama.cpp merges any pair whose join is in the vocabulary, so every split is
    listed, not only the one the trainer learned."""
    out = []
    for piece in pieces:
        pairs = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        out += sorted(pairs, key=lambda p: vocab[p[0]])
    return [list(p) for p in out]


def smallest(alphabet: list[str], n_specials: int, n_bytes: int) -> int:
    """The vocabulary before any merge: specials, bytes and the alphabet's characters (one
    SPACE for the space)."""
    return n_specials + n_bytes + len({SPACE if c == " " else c for c in alphabet})


def nfc(texts: Iterable[str]) -> Iterator[str]:
    """The texts as prepare gives them to the model (NFC)."""
    for t in texts:
        yield unicodedata.normalize("NFC", t)
