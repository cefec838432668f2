"""Which form a tokenizer.json has, for the outside runtimes that read it. One test of each form,
read by the GGUF export and the genai files alike:

- SentencePiece BPE (the spm style, as transformers' legacy Llama conversion writes it), which
  llama.cpp's "llama" vocabulary and onnxruntime-genai's SentencePiece mode run id for id;
- byte-level BPE (GPT-2's form: SmolLM2, Qwen, doel's gguf style): regex splits, each piece's
  UTF-8 bytes spelled as GPT-2's 256 printable characters, BPE over those, no byte fallback, no
  normalizer, a ByteLevel decoder. `splits` gives its regexes in the order tokenizers runs them,
  the form llama.cpp's pre-tokenizer types are listed in (its src/llama-vocab.cpp,
  `llm_tokenizer_bpe`: one regex after another, each cutting the pieces of the last).

`why_not_byte_level` names the first difference from the byte-level form in a few words, for
the refusals that quote it.
"""

from __future__ import annotations

SPACE = "\u2581"  # SentencePiece's space, "▁"
SPM_NORMALIZER = [
    {"type": "Prepend", "prepend": SPACE},
    {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
]
SPM_DECODER = ["Replace", "ByteFallback", "Fuse", "Strip"]
# The split tokenizers' ByteLevel pre-tokenizer makes with use_regex (GPT-2's pattern,
# tokenizers/src/pre_tokenizers/byte_level.rs), and what its Digits pre-tokenizer splits.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DIGIT, DIGITS = r"\p{N}", r"\p{N}+"


def is_sentencepiece(tok: dict) -> bool:
    """Whether this tokenizer.json is the SentencePiece form (byte fallback, no pre-tokenizer,
    the "▁" normalizer and decoder)."""
    model = tok.get("model") or {}
    norm = tok.get("normalizer") or {}
    decoder = tok.get("decoder") or {}
    return (
        model.get("type") == "BPE"
        and bool(model.get("byte_fallback"))
        and not model.get("ignore_merges")
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
        and tok.get("pre_tokenizer") is None
        and norm.get("type") == "Sequence"
        and norm.get("normalizers") == SPM_NORMALIZER
        and [d.get("type") for d in decoder.get("decoders", [])] == SPM_DECODER
    )


def _steps(part: dict | None, key: str) -> list[dict]:
    """A pre-tokenizer's or decoder's steps: a Sequence's, else the one (none for null)."""
    if not part:
        return []
    return list(part.get(key, [])) if part.get("type") == "Sequence" else [part]


def _split(step: dict) -> str | None:
    """The regex one step before the byte-level one splits with: an isolated Split's, or
    Digits' (each digit alone, or runs of them); None for any other step."""
    if step.get("type") == "Split":
        regex = (step.get("pattern") or {}).get("Regex")
        if step.get("behavior") == "Isolated" and not step.get("invert") and regex:
            return regex
    if step.get("type") == "Digits":
        return DIGIT if step.get("individual_digits") else DIGITS
    return None


def why_not_byte_level(tok: dict) -> str | None:
    """None for a byte-level BPE tokenizer.json; else its first difference from that form."""
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model, not BPE"
    pre = pre_steps(tok)
    decoder = _steps(tok.get("decoder"), "decoders")
    byte_level = any(s.get("type") == "ByteLevel" for s in pre + decoder)
    if model.get("byte_fallback"):
        if not byte_level:
            return "BPE over characters with byte fallback and a split of its own (the doel style)"
        return (
            "a byte-level BPE with byte fallback and a decoder of its own besides (as "
            "transformers rebuilds a GGUF's; a plain ByteLevel BPE has neither)"
        )
    if not byte_level:
        return "BPE over characters, not bytes"
    if (
        model.get("ignore_merges")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return "its BPE skips merges or marks word parts"
    norm = tok.get("normalizer")
    if norm and _steps(norm, "normalizers"):
        return f"it normalizes text ({norm.get('type')})"
    last = pre[-1] if pre else {}
    if (
        last.get("type") != "ByteLevel"
        or last.get("add_prefix_space")
        or any(_split(s) is None for s in pre[:-1])
    ):
        return "its pre-tokenizer is not regex splits followed by byte-level"
    if [d.get("type") for d in decoder] != ["ByteLevel"]:
        return "its decoder is not byte-level"
    return None


def pre_steps(tok: dict) -> list[dict]:
    """The pre-tokenizer's steps, in order."""
    return _steps(tok.get("pre_tokenizer"), "pretokenizers")


def splits(tok: dict) -> tuple[str, ...]:
    """A byte-level BPE's split regexes in the order it applies them (`why_not_byte_level` None
    first): each step's, and GPT-2's last where its ByteLevel step splits too (use_regex)."""
    pre = pre_steps(tok)
    found = tuple(_split(s) for s in pre[:-1])
    return found + ((GPT2_SPLIT,) if pre[-1].get("use_regex", True) else ())
