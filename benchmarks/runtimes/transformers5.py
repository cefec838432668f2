"""transformers' newest 5.x (in a venv of its own: doel's pins 4.57 for optimum) reads a bundle
of doel's default tokenizer as doel does: AutoTokenizer's ids equal `tokenizers`' on every line
of the shared validation split and on blocks of 20 lines, its decode gives the text back, and
`apply_chat_template` renders doel-serve's chat prompt. 5.x rebuilt its tokenizer classes (one
backend per model family), so 4.57 agreeing says nothing about it.

Run alone: `python -m benchmarks.runtimes.transformers5` prints the rows as JSON. The part that
runs in that venv is `probe` (this file run as a script, `probe IN.json OUT.json`): it imports
transformers alone, nothing of doel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}; this module returns rows
VENV = Path.home() / ".cache" / "doel" / "transformers5-venv" / "bin" / "python"


def probe(spec: dict) -> dict:
    """In the venv: ids, decodes and chat prompts of AutoTokenizer on the bundle folder."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(spec["bundle"])
    ids = tok(spec["texts"])["input_ids"]
    kw = {"tokenize": False, "add_generation_prompt": True}  # as doel-serve asks for a reply
    chat = [tok.apply_chat_template(m, **kw) for m in spec["chat"]]
    return {
        "version": transformers.__version__,
        "class": type(tok).__name__,
        "ids": ids,
        "decoded": tok.batch_decode(ids, skip_special_tokens=True),
        "chat": chat,
    }


def run_probe(spec: dict, work: Path) -> dict:
    """`probe` in the venv (this file as a script: it imports nothing of doel there)."""
    src, dst = work / "tf5-in.json", work / "tf5-out.json"
    src.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    cmd = [str(VENV), str(Path(__file__).resolve()), "probe", str(src), str(dst)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"the probe failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(dst.read_text(encoding="utf-8"))


def _row(version: str, check: str, bad: int, total: int) -> dict:
    result = f"{bad} of {total} differ"
    return {"runtime": "transformers", "version": version, "check": check, "result": result} | {
        "ok": not bad
    }


def rows(work: Path) -> list[dict]:
    if not VENV.exists():
        why = f"no venv at {VENV} (.ci/outside_tools makes it)"
        return [
            {"runtime": "transformers", "version": "5.x", "check": "ids", "result": why}
            | {"ok": False}
        ]
    from tokenizers import Tokenizer

    from benchmarks.runtimes.genai import CHATS, blocks, build, validation_lines
    from doel.serve.core.template import ChatTemplate

    work.mkdir(parents=True, exist_ok=True)
    bundle, lines = build(work)["int4"], validation_lines()
    texts = [t for ls in lines.values() for t in (*ls, *blocks(ls))]
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    want = [e.ids for e in tok.encode_batch(texts)]
    got = run_probe({"bundle": str(bundle), "texts": texts, "chat": CHATS}, work)
    v = f"{got['version']} ({got['class']})"
    chat = ChatTemplate.load(bundle)
    back = [a != b for a, b in zip(got["decoded"], tok.decode_batch(want), strict=True)]
    return [
        _row(v, "AutoTokenizer ids == tokenizers, validation lines and blocks",
             sum(a != b for a, b in zip(got["ids"], want, strict=True)), len(texts)),
        _row(v, "decode == tokenizers' decode, validation lines and blocks", sum(back), len(texts)),
        _row(v, "apply_chat_template == doel-serve's chat prompt",
             sum(a != chat.render(m) for a, m in zip(got["chat"], CHATS)), len(CHATS)),
    ]  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        spec = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        Path(sys.argv[3]).write_text(json.dumps(probe(spec), ensure_ascii=False), "utf-8")
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
