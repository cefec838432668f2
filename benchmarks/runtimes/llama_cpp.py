"""llama.cpp reads the GGUF of a model on doel's default tokenizer (spm) as doel does: the ids of
llama-server's own `/tokenize` (with `<|bos|>`, as its completions add it) equal `tokenizers'`
on every line of the shared validation split and on blocks of 20 lines, Bangla and English (its
`/detokenize` joins pieces as they are, the SentencePiece prefix space kept, so it is no test of
decoding). The llama-server binary is the one
benchmarks/load/load_servers.py builds from llama-cpp-python's vendored llama.cpp; the model is
genai.py's (the same checkpoint), written with `doel-export --format gguf`.

Run alone: `python -m benchmarks.runtimes.llama_cpp` prints the rows as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.load.load_servers import BINARY
from benchmarks.runtimes.llama_server import LlamaServer, llama_version

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}; this module returns rows


def tokenize(gguf: Path, texts: list[str], log: Path) -> list[list[int]]:
    """llama-server's own ids of each text (BOS added)."""
    with LlamaServer(gguf, log) as server:
        body = {"add_special": True}
        return [server.json("/tokenize", body | {"content": t})["tokens"] for t in texts]


def rows(work: Path) -> list[dict]:
    base = {"runtime": "llama.cpp (llama-server)"}
    if not BINARY.is_file():
        why = f"{BINARY} not built (.ci/outside_tools builds it)"
        return [base | {"version": "?", "check": "ids", "result": why, "ok": False}]
    from tokenizers import Tokenizer

    from benchmarks.runtimes.genai import blocks, build, validation_lines
    from doel.export.gguf import export_gguf

    work.mkdir(parents=True, exist_ok=True)
    build(work)
    export_gguf(work / "ckpt", work / "gguf", quant="f32", log=lambda _m: None)
    gguf = next((work / "gguf").glob("*.gguf"))
    tok = Tokenizer.from_file(str(work / "ckpt" / "tokenizer.json"))
    out, v = [], llama_version()
    for lang, lines in validation_lines().items():
        for name, texts in ((lang, lines), (f"{lang} blocks", blocks(lines))):
            want = [e.ids for e in tok.encode_batch(texts)]
            ids = tokenize(gguf, texts, work / "llama-server.log")
            bad = sum(a != b for a, b in zip(ids, want, strict=True))
            result = f"{bad} of {len(texts)} differ"
            check = f"/tokenize ids == tokenizers, {name} (validation)"
            out.append(base | {"version": v, "check": check, "result": result, "ok": not bad})
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
