"""What onnxruntime-genai's own tokenizer needs to read a bundle's tokenizer.json as `tokenizers`
does, and the record of whether it can.

genai's `og.Tokenizer` (the same C++ in its Python, C#, Java/Kotlin, Objective-C/Swift and C
APIs) is onnxruntime-extensions' tokenizer. For a BPE tokenizer.json whose decoder replaces "▁"
with a space it runs SentencePiece BPE (`spm_model_`; a decoder step stripping one " " also sets
`add_dummy_prefix_`: the "▁" in front), and then, unless the text starts with a space or the
tokenizer class is Gemma's, it first cuts the text with Llama's split regex and merges each piece
alone (operators/tokenizer/bpe_kernels.cc, `SpmTokenize`; the regex in bpe_tokenizer_model.hpp,
`GetPreTokenizerRegex`). That regex cuts a Bengali word at every vowel sign and virama (they are
marks, not letters), so "কি" came out as "▁ক" + "ি" where SentencePiece and `tokenizers` merge
"▁কি". With the class named Gemma it merges the whole text, as SentencePiece, llama.cpp and
`tokenizers` do: the same ids.

The class goes into `tokenizer_module.json`, a file onnxruntime-extensions reads after
tokenizer_config.json and lets override it (tokenizer_jsconfig.hpp, `Load`); transformers reads
no such file, so its AutoTokenizer keeps the plain fast class and tokenizer.json's own pipeline
(a Gemma class in tokenizer_config.json would make transformers build its own). `add_bos_token`
is written for the same reader: genai's Tokenizer adds no special token unless an app asks
(`update_options(add_special_tokens="true")`; its default is "false", src/models/model.cpp), and
then adds `<|bos|>` once, as tokenizer.json's post-processor does. The chat template starts with
`<|bos|>` itself.

A byte-level BPE (GPT-2's form: doel's gguf style, SmolLM2's) needs nothing: onnxruntime-extensions
implements GPT-2's byte-level BPE natively and runs the pre-tokenizer's Split regexes (GPT-2's own
where it has none) as `tokenizers` does (tests/export/test_genai.py). It skips a Digits step,
though: it accepts the step's type but collects only Split patterns (bpe_tokenizer_model.hpp,
`LoadPreTokenizer`), so a tokenizer that splits digits first (SmolLM2's, StarCoder's) can merge a
space into the numeral after it where `tokenizers` keeps them apart: on SmolLM2's, " ٣" and
" ½" (1 of 131 lines and corner cases differed, under genai 0.15.2 and 0.18.0; the same files with
GPT-2's pipeline, none). Such a tokenizer, and any other form, the "doel" style included (BPE
over characters with byte fallback, no "▁", where Bangla comes out as -1 ids or an error), is
recorded as not exact: the export says so in one line naming why, and the manifest records it
(`genai_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from doel.export.common import write_json
from doel.export.tokenform import is_sentencepiece, pre_steps, why_not_byte_level

MODULE = "tokenizer_module.json"  # onnxruntime-extensions' own override of tokenizer_config
MODULE_CONFIG = {"tokenizer_class": "GemmaTokenizerFast", "add_bos_token": True}
NOT_EXACT = (
    "onnxruntime-genai's own tokenizer does not give this tokenizer's ids ({why}); an app on "
    "genai must bring ids from `tokenizers`, or (a model of doel's own) train it on "
    "`doel-train tokenizer --style spm` (the default)"
)
DIGITS_SKIPPED = (
    "its pre-tokenizer splits digits first, a step onnxruntime-extensions skips, so a space "
    "can merge into a numeral after it"
)


def form(tok: dict) -> str:
    """ "spm" (doel's SentencePiece BPE form), "byte-level" (GPT-2's form) or "other"."""
    if is_sentencepiece(tok):
        return "spm"
    return "byte-level" if why_not_byte_level(tok) is None else "other"


def not_exact(tok: dict) -> str | None:
    """Why genai's tokenizer does not give this tokenizer's ids; None where it does."""
    kind = form(tok)
    if kind == "other":
        return why_not_byte_level(tok)
    if kind == "byte-level" and any(s.get("type") == "Digits" for s in pre_steps(tok)):
        return DIGITS_SKIPPED
    return None


def write_genai_files(tok: dict, stage: Path, log=print) -> dict:
    """tokenizer_module.json for the spm form; the manifest's `genai_tokenizer` record. Says in
    one line when genai's tokenizer cannot give this tokenizer's ids."""
    kind = form(tok)
    if kind == "spm":
        write_json(stage / MODULE, MODULE_CONFIG)
    reason = not_exact(tok)
    if reason is not None:
        why = NOT_EXACT.format(why=reason)
        log(f"note: {why}")
        return {"exact": False, "form": kind, "why": why}
    return {"exact": True, "form": kind, "add_special_tokens": "true"}
