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
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.load.load_servers import BINARY, free_port

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}; this module returns rows


def _post(port: int, path: str, body: dict, timeout: float = 60) -> dict:
    data = json.dumps(body, ensure_ascii=False).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _up(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            _post(port, "/tokenize", {"content": "x"}, timeout=5)
            return
        except (OSError, urllib.error.URLError):
            if time.monotonic() > end:
                raise
            time.sleep(0.3)


def tokenize(gguf: Path, texts: list[str], log: Path) -> list[list[int]]:
    """llama-server's own ids of each text (BOS added)."""
    port = free_port()
    cmd = [str(BINARY), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", "256",
           "-np", "1", "-t", "2", "--no-webui"]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _up(port, proc)
        body = {"add_special": True}
        return [_post(port, "/tokenize", body | {"content": t})["tokens"] for t in texts]
    finally:
        proc.terminate()
        proc.wait(30)


def version() -> str:
    out = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, timeout=30)
    line = next((x for x in (out.stdout + out.stderr).splitlines() if "version" in x), "?")
    return line.split(":", 1)[-1].strip()


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
    out, v = [], version()
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
