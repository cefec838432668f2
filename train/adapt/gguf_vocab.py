"""A GGUF's tokenizer rebuilt as the tokenizer.json that tokenizes as llama.cpp does, id for id.

llama.cpp does not store a tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`,
their types, the merges) and names its own tokenizer for it: `tokenizer.ggml.model` ("gpt2": a
byte-level BPE) and `tokenizer.ggml.pre`, a pre-tokenizer name that llama.cpp maps to a list of
split regexes (src/llama-vocab.cpp, `llm_tokenizer_bpe`), applied one after the other, each to
the pieces the one before made. So the rebuilt tokenizer is exactly that: a Split (isolated) per
regex in llama.cpp's order, then the byte-level mapping with no regex of its own, the BPE with
the GGUF's merges and no byte fallback, a byte-level decoder, no normalizer. Control tokens
become special added tokens, user-defined ones plain added tokens, as llama.cpp matches both in
text; BOS is added in front only where `tokenizer.ggml.add_bos_token` says so.

Transformers 4.57 rebuilds such a GGUF differently (a BPE with byte fallback beside a byte-level
pre-tokenizer, and a SentencePiece-style decoder): a hybrid no runtime reproduces, which
doel-export's GGUF writer then refuses (../shared/notes/real-model.md). Only the pre-tokenizers
whose regexes are copied below are rebuilt; any other is refused, naming it, rather than
guessed: a wrong split gives other ids for the same text, silently.
"""

from __future__ import annotations

from doel.contracts import untrusted
from doel.train.adapt.shape import Refused

# llama.cpp's regexes by pre-tokenizer name (src/llama-vocab.cpp, the llama.cpp that
# llama-cpp-python 0.3.36 vendors: LLAMA_VOCAB_PRE_TYPE_STARCODER's list is SmolLM's). GPT-2's
# is written as tokenizers writes it (its ByteLevel step's pattern), with the last "|\s+" that
# llama.cpp's copy leaves out: an isolated split keeps what no branch matches as a piece of its
# own, so the pieces are the same, and doel-export's GGUF writer (export/tokenform.py) knows the
# pattern in this form.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DIGITS = r"\p{N}"
SPLITS = {
    **{name: (DIGITS, GPT2) for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{name: (GPT2,) for name in ("gpt-2", "phi-2", "mpt", "olmo")},
}
# gguf's TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
HINT = "import the Hugging Face folder the GGUF was made from instead"


def pre_tokenizer(pre: str) -> dict:
    """tokenizer.json's pre_tokenizer for llama.cpp's pre-tokenizer `pre`."""
    splits = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in SPLITS[pre]
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    return {"type": "Sequence", "pretokenizers": [*splits, byte_level | {"use_regex": False}]}


def _added(i: int, text: str, special: bool) -> dict:
    return {
        "id": i,
        "content": text,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _post_processor(bos: int | None, tokens: list[str], add_bos: bool) -> dict | None:
    if not add_bos:
        return None
    if bos is None:
        raise Refused("the GGUF adds a BOS token but names none (tokenizer.ggml.bos_token_id)")
    name = tokens[bos]
    first = [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    return {
        "type": "TemplateProcessing",
        "single": first,
        "pair": [*first, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [bos], "tokens": [name]}},
    }


def _merges(merges: list[str], vocab: dict[str, int]) -> list[list[str]]:
    pairs = []
    for n, merge in enumerate(merges):
        pair = merge.split(" ")
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
            raise Refused(
                f"tokenizer.ggml.merges[{n}] is {merge[:40]!r}, not two tokens of the "
                f"vocabulary; the GGUF is damaged, or {HINT}"
            )
        pairs.append(pair)
    return pairs


def tokenizer_json(meta: dict, vocab_size: int) -> dict:
    """The tokenizer.json of a GGUF's `tokenizer.ggml.*` metadata (`meta`: key -> value), or
    Refused naming what it cannot rebuild."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2":
        raise Refused(
            f"tokenizer.ggml.model is {model!r}: doel rebuilds byte-level BPE ('gpt2') "
            f"tokenizers only; {HINT}"
        )
    if pre not in SPLITS:
        raise Refused(
            f"tokenizer.ggml.pre is {pre!r}, a split doel does not rebuild (it does "
            f"{', '.join(sorted(SPLITS))}); {HINT}"
        )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges") or []
    for key, items in (("tokens", tokens), ("merges", merges)):
        untrusted.whole(len(items), f"tokenizer.ggml.{key} (its length)", untrusted.MAX_VOCAB)
    if len(types) != len(tokens) or len(tokens) > vocab_size:
        raise Refused(
            f"the GGUF has {len(tokens)} tokens, {len(types)} token types and an embedding of "
            f"{vocab_size} rows; they must agree; {untrusted.AGAIN}"
        )
    vocab: dict[str, int] = {}
    added = []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            added.append(_added(i, text, special=kind == CONTROL))
            vocab.setdefault(text, i)
        elif vocab.setdefault(text, i) != i:
            raise Refused(f"token {i} ({text[:40]!r}) is also token {vocab[text]}; {HINT}")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if meta.get("tokenizer.ggml.add_eos_token"):
        raise Refused(f"the GGUF adds an EOS token after every text, which doel does not; {HINT}")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer(pre),
        "post_processor": _post_processor(bos, tokens, add_bos),
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },  # fmt: skip
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _merges(merges, vocab),
        },
    }
