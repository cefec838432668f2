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

The byte-level "gguf" style needs nothing: extensions runs its split regex and byte-level BPE as
`tokenizers` does. The "doel" style (BPE over characters with byte fallback, no "▁") is neither
form: genai cannot read it exactly (Bangla comes out as -1 ids or an error), and the export says
so and records it in the manifest (`genai_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from doel.export.common import write_json
from doel.export.tokenform import is_sentencepiece

MODULE = "tokenizer_module.json"  # onnxruntime-extensions' own override of tokenizer_config
MODULE_CONFIG = {"tokenizer_class": "GemmaTokenizerFast", "add_bos_token": True}
NOT_EXACT = (
    "onnxruntime-genai's own tokenizer does not give this tokenizer's ids (a BPE over characters "
    "without SentencePiece's '▁': the doel style); an app on genai must bring ids from "
    "`tokenizers`, or train the model on `doel-train tokenizer --style spm` (the default)"
)


def form(tok: dict) -> str:
    """ "spm" (doel's SentencePiece BPE form), "byte-level" (the gguf style) or "other"."""
    if is_sentencepiece(tok):
        return "spm"
    norm, decoder = tok.get("normalizer") or {}, tok.get("decoder") or {}
    if (tok.get("model") or {}).get("type") != "BPE":
        return "other"
    if decoder.get("type") == "ByteLevel" and norm == {}:
        return "byte-level"
    return "other"


def write_genai_files(tok: dict, stage: Path, log=print) -> dict:
    """tokenizer_module.json for the spm form; the manifest's `genai_tokenizer` record. Says in
    one line when genai's tokenizer cannot give this tokenizer's ids."""
    kind = form(tok)
    if kind == "spm":
        write_json(stage / MODULE, MODULE_CONFIG)
    if kind == "other":
        log(f"note: {NOT_EXACT}")
        return {"exact": False, "form": kind, "why": NOT_EXACT}
    return {"exact": True, "form": kind, "add_special_tokens": "true"}
