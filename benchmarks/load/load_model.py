"""The load benchmark's model: the 0.4B preset's random weights with a tokenizer that covers
every id the model can emit, as an int4/int8 doel bundle and q4_0/q8_0 GGUF files.

Random weights pick ids uniformly over the embedding's 32,768 rows. bench_serve's checkpoint has
a 4,096-token tokenizer (ids beyond it decode to nothing), so doel-serve streamed its text in
clumps and time to first token meant nothing (../shared/notes/peers-and-reach.md). Here the
tokenizer is the default spm style trained at the model's vocabulary size on the shared train
split (Bangla and English): every id is a piece of text (all but 256 byte pieces and a few
controls), both servers stream one piece a token, and llama.cpp tokenizes text as the tokenizer
does (benchmarks/results/spm.md proves it id for id), so both get the same text prompts.
Every file is made by doel's own commands (`doel-export`, its `--format gguf` for llama.cpp) from
one checkpoint, kept in a cache folder keyed by the preset, and made once.

The second model (`model="smollm2-135m"`, issue 57): SmolLM2-135M-Instruct imported by
bench_real_model's helper, real weights and its own tokenizer; its GGUF files are converted by
llama.cpp's own converter (bench_serve_llama.make_ggufs, as bench_real_model does), and its
bundles are exported with the loss bound lifted (the int4 bound refuses every int4 of it, q4_0
included: speed is what is measured here, its loss is bench_real_model's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
TOKENIZER_CHARS = 3_000_000  # enough text for 32,768 pieces; trains in about a minute
BANGLA_SHARE = 0.55


def split_files(split: str, shared: Path = SHARED) -> dict[str, list[Path]]:
    """{'bn': [...], 'en': [...]}: a split of ../shared/data/splits.json, as paths."""
    splits = shared / "splits.json"
    if not splits.is_file():
        raise SystemExit(f"{splits} is missing: the load benchmark needs the shared Bangla text")
    table = json.loads(splits.read_text())
    return {lang: [shared / f for f in table[lang][split]] for lang in ("bn", "en")}


def _tokenizer(work: Path, vocab: int) -> Path:
    from benchmarks.train.bench_tokenizer import language_weights
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    out = work / "tok"
    if (out / "tokenizer.json").is_file():
        return out / "tokenizer.json"
    files = split_files("train")
    sources = resolve_sources([str(f) for f in files["bn"] + files["en"]])
    weights = language_weights(sources, len(files["bn"]), BANGLA_SHARE)
    cfg = TokenizerConfig(vocab_size=vocab, max_chars=TOKENIZER_CHARS)
    return train_tokenizer(sources, cfg, out, weights, progress=False)


def checkpoint(work: Path, preset: str = "bangla-0.4b") -> Path:
    """Random weights of the preset (seed 0), saved with the full-vocabulary tokenizer."""
    ckpt = work / "ckpt"
    if (ckpt / "config.json").is_file():
        return ckpt
    import torch

    from doel.train.config import load_config
    from doel.train.hf import save_model
    from doel.train.model import Llama
    from doel.train.settings import TrainConfig

    cfg = load_config(TrainConfig, ROOT / "configs" / f"{preset}.toml").model
    tok = _tokenizer(work, cfg.vocab_size)
    torch.manual_seed(0)
    return save_model(Llama(cfg), ckpt, tokenizer=tok)


def _export(ckpt: Path, out: Path, *flags: str) -> None:
    cmd = [sys.executable, "-m", "doel.export", str(ckpt), "--out", str(out), "--force", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


# Each doel bundle the load benchmarks serve: its llama.cpp peer of the same weights and width,
# and its export flags. The variants are measured beside the defaults they change: int4-kv16 is
# int4 with the KV cache in fp16 (`doel-export --kv-cache`), half the cache's memory, at what
# cost in speed is what its rows measure; int8-b128 is int8 in blocks of 128 (int8's default
# before issue 57, when the pair was int8-b256).
PAIRS = {"int4": "q4_0", "int8": "q8_0", "int4-kv16": "q4_0", "int8-b128": "q8_0"}
DEFAULT_PAIRS = ["int4", "int8"]  # what a run measures unless --pair says otherwise
EXPORT_FLAGS = {
    "int4": ("--quant", "int4"),
    "int8": ("--quant", "int8"),
    "int4-kv16": ("--quant", "int4", "--kv-cache", "fp16"),
    # int8 in blocks of 128, the default's other candidate (docs/kernels.md, "The format")
    "int8-b128": ("--quant", "int8", "--block-size", "128"),
}


MODELS = ("0.4b", "smollm2-135m")  # the shapes the load benchmarks take (--model)


def prepare(work: Path, pairs: list[tuple[str, str]], model: str = "0.4b") -> dict[str, Path]:
    """{variant: bundle folder or GGUF file} for each (doel variant of EXPORT_FLAGS, llama.cpp
    quant) pair, of `model` (MODELS)."""
    work.mkdir(parents=True, exist_ok=True)
    real = model == "smollm2-135m"
    if real:
        from benchmarks.export.bench_real_model import imported

        ckpt = imported(work)
    else:
        ckpt = checkpoint(work)
    lifted = ("--max-loss-increase", "1e6") if real else ()
    made: dict[str, Path] = {}
    for ours, peer in pairs:
        bundle = work / f"bundle-{ours}"
        if not (bundle / "manifest.json").is_file():
            print(f"exporting {ours} ...", flush=True)
            _export(ckpt, bundle, *EXPORT_FLAGS[ours], "--eval-tokens", "256", *lifted)
        made[ours] = bundle
        gguf = work / f"gguf-{peer}"
        if not list(gguf.glob("*.gguf")):
            print(f"exporting {peer} (GGUF) ...", flush=True)
            if real:
                from benchmarks.serve.bench_serve_llama import make_ggufs

                gguf.mkdir(parents=True, exist_ok=True)
                make_ggufs(ckpt, gguf, [peer])
            else:
                _export(ckpt, gguf, "--format", "gguf", "--quant", peer)
        (made[peer],) = gguf.glob(f"*{peer}.gguf" if real else "*.gguf")
    return made


class Prompts:
    """Bangla prompts cut from the shared validation split (NFC, as doel's data preparation
    gives text to a model): consecutive windows of exactly n of the bundle tokenizer's ids,
    decoded back to text, each window used once per server process (take())."""

    def __init__(self, bundle: Path, shared: Path = SHARED):
        import unicodedata

        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
        text = "\n".join(f.read_text("utf-8") for f in split_files("validation", shared)["bn"])
        self.ids = self.tok.encode(unicodedata.normalize("NFC", text), add_special_tokens=False).ids
        self.pos = 0

    def reset(self) -> None:
        """Start again from the first window (a new server process has an empty cache)."""
        self.pos = 0

    def take(self, n: int) -> str:
        if self.pos + n > len(self.ids):
            raise SystemExit(f"the validation text holds {len(self.ids):,} tokens: too few")
        window = self.ids[self.pos : self.pos + n]
        self.pos += n
        return self.tok.decode(window)

    def ids_of(self, n: int) -> list[int]:
        """The next window as ids (the in-process runs take ids, no text)."""
        window = self.ids[self.pos : self.pos + n]
        self.pos += n
        return window
