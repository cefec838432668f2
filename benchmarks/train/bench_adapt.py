"""Adapting SmolLM2-135M-Instruct to Bangla (issue 55): which tokenizer, and does it beat training
from scratch?

Two measurements on ../shared/data (splits.json: trained on the train split, measured on the
validation split), each run as its own command so that two can run at once, one a core:

1. `variant NAME`: one tokenizer choice (VARIANTS): the base's tokenizer unchanged, extended
   with the base's split, extended with the marks kept in the word, or replaced by doel's
   `spm`; its held-out Bangla and English characters per token, whether English ids stay the
   base's, and the held-out bits per character of the adapted model after the same number of
   steps of continued pretraining (the same tokens a step) on the same text.
2. `compare`: the same wall-clock budget for the default path (`doel-train adapt`'s pretraining)
   and for a from-scratch doel model of SmolLM2-135M's shape with doel's spm tokenizer, on the
   same text; held-out bits per character at the end and the validation curves.

`report` gathers what the runs wrote into benchmarks/results/adapt_tokenizers.{json,md} and
adapt_vs_scratch.{json,md,png}. Run: `python -m benchmarks.train.bench_adapt --help`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

RESULTS: tuple[str, ...] = ()
RESULTS_NOT_YET_RUN = ("adapt_tokenizers", "adapt_vs_scratch")

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
WORK = Path("/tmp/doel-bench-adapt")
# name -> (tokenizer, split): what adapt's config says for each choice
VARIANTS = {
    "base": ("keep", "base"),
    "extend-base-split": ("extend", "base"),
    "extend-marks": ("extend", "marks"),
    "spm": ("spm", "base"),
}
BN_CHARS, EN_CHARS = 2_000_000, 1_000_000  # training text (shares 2:1 by characters)
HELD_CHARS = 12_000  # held-out text a language, scored by each model
LR_ADAPT, LR_SCRATCH = 1e-4, 1e-3  # a trained model moves gently; a random one needs more


def corpus(work: Path) -> tuple[Path, Path]:
    """The training text as two JSONL files (Bangla, English) from the train split."""
    from doel.train.evals.heldout import read_texts

    splits = json.loads((SHARED / "splits.json").read_text(encoding="utf-8"))
    out = []
    for lang, n in (("bn", BN_CHARS), ("en", EN_CHARS)):
        path = work / "corpus" / f"{lang}.jsonl"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            docs = read_texts([str(SHARED / p) for p in splits[lang]["train"]], n)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
            tmp.rename(path)
        out.append(path)
    return out[0], out[1]


def held_out() -> dict[str, list[str]]:
    from doel.train.evals.heldout import read_texts

    splits = json.loads((SHARED / "splits.json").read_text(encoding="utf-8"))
    return {
        lang: read_texts([str(SHARED / p) for p in splits[lang]["validation"]], HELD_CHARS)
        for lang in ("bn", "en")
    }


def chars_per_token(tok_json: dict, texts: dict) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(tok_json))
    out = {}
    for lang, docs in texts.items():
        n = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
        out[lang] = sum(map(len, docs)) / n
    return out


def english_unchanged(base_json: dict, tok_json: dict, texts: list[str]) -> float:
    """The share of English held-out documents whose ids are the base's, exactly."""
    from tokenizers import Tokenizer

    a = Tokenizer.from_str(json.dumps(base_json)).encode_batch(texts, add_special_tokens=False)
    b = Tokenizer.from_str(json.dumps(tok_json)).encode_batch(texts, add_special_tokens=False)
    return sum(x.ids == y.ids for x, y in zip(a, b)) / len(texts)


def heldout_bits(model_dir: Path, texts: dict) -> dict:
    """Held-out bits per character a language, each document after its start token."""
    import unicodedata

    from tokenizers import Tokenizer

    from doel.train.adapt.pretrain import document_markers
    from doel.train.evals.heldout import doc_figures
    from doel.train.hf import load_model

    model = load_model(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    start, _ = document_markers(model_dir)
    out = {}
    for lang, docs in texts.items():
        docs = [unicodedata.normalize("NFC", d) for d in docs if d]
        ids = [[start, *e.ids] for e in tok.encode_batch(docs, add_special_tokens=False)]
        out[lang] = doc_figures(model, docs, ids, seq_len=256, batch_size=4)["bits_per_char"]
    return out


def _args_variant(ap) -> None:
    ap.add_argument("name", choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--base", type=Path, default=WORK / "smollm2")


def pretrain_config(steps: int, lr: float, time_limit: float = 0.0, eval_every: int = 0):
    from doel.train.settings import TrainConfig

    return TrainConfig(
        seq_len=256, batch_size=2, grad_accum=1, steps=steps, lr=lr,
        warmup_steps=max(1, steps // 10), dtype="float32", device="cpu", checkpoint_every=0,
        eval_every=eval_every, eval_batches=4, log_every=5, time_limit=time_limit,
    )  # fmt: skip


def base_model(path: Path) -> Path:
    from doel.train.adapt.importing import import_model
    from doel.train.adapt.smollm2 import smollm2_gguf

    if not (path / "config.json").is_file():
        gguf, why = smollm2_gguf()
        if gguf is None:
            raise SystemExit(f"no SmolLM2: {why}")
        import_model(gguf, path, force=True)
    return path


def run_variant(name: str, steps: int, base: Path, work: Path) -> dict:
    """Build, shard, train and score one tokenizer variant; its row (also written to work)."""
    from doel.train.adapt.pretrain import continue_pretraining, make_shards
    from doel.train.adapt.run import AdaptConfig, adapted_model
    from doel.train.data.prepare import PrepareConfig

    bn, en = corpus(work)
    texts = held_out()
    kind, split = VARIANTS[name]
    base = base_model(base)
    vdir = work / name
    cfg = AdaptConfig(tokenizer=kind, split=split, tokenizer_chars=BN_CHARS)
    model, n_base = adapted_model(base, [str(bn), str(en)], vdir, cfg)
    base_json = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    tok_json = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    row = {
        "variant": name,
        "tokenizer": kind,
        "split": split,
        "vocab": n_base if kind == "keep" else len(tok_json["model"]["vocab"]),
        "chars_per_token": chars_per_token(tok_json, texts),
        "english_ids_unchanged": english_unchanged(base_json, tok_json, texts["en"]),
    }
    t0 = time.time()
    row["bits_per_char_before"] = heldout_bits(model, texts)
    row["score_seconds"] = time.time() - t0
    weights = ["bn=2", "en=1"]
    # the shards' own validation split draws the curves; the poems repeat lines across
    # documents, so their overlap is tolerated (the figures are on splits.json's held-out files)
    prep = PrepareConfig(val_fraction=0.01, max_val_overlap=1.0)
    make_shards(model, [str(bn), str(en)], vdir, prep, weights)
    t0 = time.time()
    final = continue_pretraining(
        pretrain_config(steps, LR_ADAPT), model, vdir / "shards", vdir / "run", n_base,
        fresh=True, skip_verify=True,
    )  # fmt: skip
    row |= {"steps": steps, "train_seconds": time.time() - t0}
    row["bits_per_char_after"] = heldout_bits(final, texts)
    (work / f"variant-{name}.json").write_text(json.dumps(row, indent=2), encoding="utf-8")
    print(json.dumps(row, indent=2))
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=WORK)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _args_variant(sub.add_parser("variant", help="one tokenizer variant"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.cmd == "variant":
        run_variant(args.name, args.steps, args.base, args.work)
    _ = math


if __name__ == "__main__":
    main()
