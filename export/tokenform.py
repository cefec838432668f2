"""Which form a tokenizer.json has, for the outside runtimes that read it: doel's SentencePiece
BPE (the spm style, as transformers' legacy Llama conversion writes it), which llama.cpp's
"llama" vocabulary and onnxruntime-genai's SentencePiece mode run id for id. One test of the
form, read by the GGUF export and the genai files alike."""

from __future__ import annotations

SPACE = "\u2581"  # SentencePiece's space, "▁"
SPM_NORMALIZER = [
    {"type": "Prepend", "prepend": SPACE},
    {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
]
SPM_DECODER = ["Replace", "ByteFallback", "Fuse", "Strip"]


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
