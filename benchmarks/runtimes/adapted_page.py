"""The browser page on an adapted vocabulary (issue 55): `doel-train adapt`'s default tokenizer,
SmolLM2-135M-Instruct's byte-level BPE extended with Bangla merges under llama.cpp's qwen35 split
(a `(?i:'s|...)` group and `[\\p{L}\\p{M}]+` in its regex), read by the page's own tokenizer
(tokenizers.js, in headless Chromium) exactly as `tokenizers` reads it.

The vocabulary: bench_adapt's default variant where its work folder holds it (the same text and
settings as adapt_tokenizers.md's row), else made here the same way (SmolLM2's GGUF from the
cache, the first 2,000,000 Bangla characters of the train split, 8,192 new tokens). A tiny random
Llama carries it (its weights say nothing here), with the base's side files (ChatML, stops),
exported at int4 with --web, the page's default. The page encodes every line of the shared
validation split and its blocks of 20 lines (the text of genai's and llama.cpp's rows), and the
corners of a split regex; its greedy text for two prompts is set beside doel-serve's on the same
bundle (it decodes the new tokens). Rows from `rows(work)`; `python -m
benchmarks.runtimes.adapted_page [WORK]` prints them as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}
NAME = "the browser page (doel-export --web, int4, its default path)"
LABEL = "SmolLM2 adapted (extend-qwen35)"
# the corners of a split regex (test_web's, with qwen35's case-insensitive contractions)
EDGE = [
    "  two  spaces\tand\ttabs\r\nlines\n",
    "য় ড় ঢ় and decomposed য\u09bc, ক্\u200dষ ক্\u200cষ, ৳১,২৩৪.৫০ 12345",
    "<|im_start|>hi<|im_end|> I'LL we'Ve DON'T “উদ্ধৃতি” ‘কথা’ — শেষ…",
    "emoji 😀🇧🇩, é e\u0301, nbsp\u00a0em\u2003ideographic\u3000nel\u0085",
]
PROMPTS = ["বাংলাদেশের রাজধানীর নাম", "The bird sang"]


def adapted_tokenizer(work: Path) -> Path:
    """A folder with the adapted tokenizer.json and the base's side files: bench_adapt's (its
    work folder: $DOEL_ADAPT_WORK, else its default), or made here as it makes them."""
    from benchmarks.train import bench_adapt as ba
    from doel.train.adapt.init import SIDE_FILES

    made = Path(os.environ.get("DOEL_ADAPT_WORK", ba.WORK)) / ba.DEFAULT / "adapted"
    if (made / "tokenizer.json").is_file():
        return made
    out = work / "adapted-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    from doel.train.adapt.run import AdaptConfig, bangla_texts
    from doel.train.adapt.vocab import extend

    base = ba.base_model(work / "smollm2")
    cfg = AdaptConfig()  # the default path: extend, qwen35, 8,192 new tokens
    bn, en = ba.corpus(work)
    texts = bangla_texts([str(bn), str(en)], ba.BN_CHARS + ba.EN_CHARS)
    base_json = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    tok = extend(base_json, texts, cfg.new_tokens, cfg.split)
    out.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return out


def build(work: Path) -> dict:
    """The tiny model on the adapted vocabulary, its int4 bundle with the page; their paths."""
    import torch
    from tokenizers import Tokenizer

    from benchmarks.runtimes.end_of_document import web_export
    from doel.train.adapt.init import keep_tokenizer_files
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    source = adapted_tokenizer(work)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    gen = json.loads((source / "generation_config.json").read_text(encoding="utf-8"))
    stops = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=gen.get("bos_token_id", 1), eos_token_id=stops[0],
                      pad_token_id=gen.get("pad_token_id", stops[0]))  # fmt: skip
    for old in (work / "ckpt", work / "bundle-int4-web"):  # made afresh: the vocabulary may not be
        shutil.rmtree(old, ignore_errors=True)  # the one they were made of
    torch.manual_seed(0)
    ckpt = save_model(Llama(cfg).eval(), work / "ckpt", tokenizer=source / "tokenizer.json")
    keep_tokenizer_files(ckpt, source)  # the base's template, specials and stops
    return {"source": source, "tokenizer": tok, "bundle": web_export(ckpt, work)}


def texts() -> dict[str, list[str]]:
    """The texts genai's and llama.cpp's rows read: every line of the shared validation split,
    NFC, and blocks of 20 lines, a language; and the corners of a split regex."""
    from benchmarks.runtimes.genai import blocks, validation_lines

    out = {}
    for lang, lines in validation_lines().items():
        out[f"{lang} (validation)"] = lines
        out[f"{lang} blocks (validation)"] = blocks(lines)
    out["a split regex's corners"] = EDGE
    return out


def page_run(bundle: Path, cases: dict[str, list[str]]) -> dict:
    """The page loaded in headless Chromium: its facts, doel.encode() of every case, and its
    greedy text for PROMPTS."""
    from benchmarks.runtimes.end_of_document import MAX_NEW, opened_page
    from benchmarks.web.bench_web import settled

    with opened_page(bundle) as (driver, facts):
        out = {"facts": facts, "ids": {}, "text": {}}
        for kind, lines in cases.items():
            got = settled(driver, "doel.encode(arguments[0]).then((ids) => ({ids}))", lines)
            out["ids"][kind] = got["ids"]
        for prompt in PROMPTS:
            req = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            out["text"][prompt] = settled(driver, "doel.generate(arguments[0])", req)["text"]
    return out


def _row(version: str, check: str, result: str, ok: bool) -> dict:
    return {"runtime": NAME, "version": version, "check": f"{LABEL}: {check}", "result": result,
            "ok": ok}  # fmt: skip


def rows(work: Path) -> list[dict]:
    from benchmarks.runtimes.end_of_document import chromium_version, doel_serve

    work = Path(work)
    chromium = chromium_version()
    if chromium is None:
        return [_row("-", "the page's tokenizer", "not run: no Chromium / chromedriver", False)]
    work.mkdir(parents=True, exist_ok=True)
    built = build(work)
    tok, version = built["tokenizer"], f"Chromium {chromium}"
    cases = texts()
    page = page_run(built["bundle"], cases)
    lib = _tokenizers_js_version()
    vocab = f"{tok.get_vocab_size():,} tokens"
    out = []
    for kind, lines in cases.items():
        want = [e.ids for e in tok.encode_batch(lines)]
        got = page["ids"][kind]
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        bad += list(range(len(got), len(want)))  # lines the page gave nothing for
        first = f"; first: {lines[bad[0]][:60]!r}" if bad else ""
        out.append(_row(
            version,
            f"the page's tokenizer ({lib}) ids == tokenizers, {kind}, {vocab}",
            f"{len(bad)} of {len(lines)} differ{first}",
            not bad,
        ))  # fmt: skip
    for prompt in PROMPTS:
        serve = doel_serve(built["bundle"], prompt)["text"]
        got = page["text"][prompt]
        out.append(_row(
            version,
            f"greedy text for {prompt!r} == doel-serve's on the same int4 bundle (tiny random "
            "weights: the new tokens decoded)",
            f"page {got!r}, doel-serve {serve!r}",
            got == serve,
        ))  # fmt: skip
    return out


def _tokenizers_js_version() -> str:
    """tokenizers.js's version, from the web runtime's lock file the export copies from."""
    lock = Path(__file__).resolve().parents[2] / "export" / "web" / "package-lock.json"
    packages = json.loads(lock.read_text(encoding="utf-8")).get("packages", {})
    found = packages.get("node_modules/@huggingface/tokenizers", {}).get("version")
    return f"tokenizers.js {found}" if found else "tokenizers.js"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)), indent=1,
                         ensure_ascii=False))  # fmt: skip
