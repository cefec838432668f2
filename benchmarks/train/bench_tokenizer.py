"""Tokenizer benchmark on ../shared/data: is doel's tokenizer fair to Bangla; how fast are
shards written?

1. Train tokenizers at 32,768 tokens on the train split of splits.json: doel's, its ablations
   (byte-level BPE; the plain pre-tokenizer fix; the natural language mix) and a GPT-2-style
   byte-level BPE (the trap), all on the same text.
2. Characters/token, tokens/word (the unit most Bangla tokenizer papers give) and byte-fallback
   rate on the validation split, per language, for those and for the reference tokenizers in
   ../shared/data/tokenizers.
3. Shard writing (`doel-train prepare`) against the tokenizers library's plain `encode_batch`
   on the same documents, in the same run: tokens/s and their ratio.

Writes benchmarks/results/tokenizer.{json,md,png}. Run: `make bench-tokenizer`.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks.common.report import heading, machine, parser, publish
from doel.train.data.fertility import fertility, load_any
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.textio import iter_source, resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

RESULTS = ("tokenizer",)

ROOT = Path(__file__).resolve().parents[2]

REFERENCES = {
    "GPT-2": "gpt2/tokenizer.json",
    "cl100k (GPT-4)": "openai_cl100k/cl100k_base.tiktoken",
    "Whisper multilingual": "whisper/multilingual.tiktoken",
    "Llama 2": "llama2/tokenizer.model",
    "Mistral v3": "mistral/mistral_instruct_tokenizer_240323.model.v3",
    "Mistral Tekken": "mistral/tekken_240718.json",
    "BNLP SentencePiece (bn only)": "bnlp_sentencepiece/bn_spm.model",
    "Bangla-BERT WordPiece (bn only)": "bangla_bert_base_sagorbrur/vocab.txt",
}
TARGETS = {"bn_chars_per_token": 4.4, "en_chars_per_token": 4.0, "bn_byte_fallback": 0.001}


def language_weights(sources, n_bn: int, bn_share: float) -> dict[str, float]:
    """Per-source shares of characters: bn_share for Bangla, split among its files by size."""
    chars = {s.name: sum(len(d) for d in iter_source(s)) for s in sources}
    bn, en = sources[:n_bn], sources[n_bn:]
    tb, te = sum(chars[s.name] for s in bn), sum(chars[s.name] for s in en)
    return {s.name: bn_share * chars[s.name] / tb for s in bn} | {
        s.name: (1 - bn_share) * chars[s.name] / te for s in en
    }


def measure(tok, val: dict[str, list[str]]) -> dict:
    """Characters/token etc. of each language's validation text, on that language's script."""
    out = {}
    for lang, script in (("bn", "bengali"), ("en", "latin")):
        r = fertility(tok, val[lang])[script]
        out[lang] = {
            k: r[k]
            for k in (
                "characters",
                "tokens",
                "chars_per_token",
                "bytes_per_token",
                "words_per_token",
                "tokens_per_word",
                "byte_fallback_rate",
                "partial_char_rate",
            )
        }
    out["bn_over_en"] = out["bn"]["chars_per_token"] / out["en"]["chars_per_token"]
    return out


def plain_shard_writer(tok_path: Path, paths: list[str], out: Path) -> int:
    """The same job done plainly with the library: load, read, encode_batch, flatten, write."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    docs = [d for s in resolve_sources(paths) for d in iter_source(s)]
    ids = np.array([t for e in tok.encode_batch(docs) for t in e.ids], dtype=np.uint16)
    ids.tofile(out)
    return len(ids)


def throughput(tok_path: Path, paths: list[str], repeats: int) -> dict:
    """doel's shard writing vs the plain library on the same documents, interleaved runs."""
    docs = [d for s in resolve_sources(paths) for d in iter_source(s)]
    tok = load_tokenizer(tok_path)
    ours, plain, plain_writer = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        n_plain = sum(len(e.ids) for e in tok.encode_batch(docs))
        plain.append(n_plain / (time.perf_counter() - t))
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            n = plain_shard_writer(tok_path, paths, Path(tmp) / "plain.bin")
            plain_writer.append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            meta = prepare(
                tok_path, paths, tmp, PrepareConfig(), progress=False, log=lambda *_: None
            )
            dt = time.perf_counter() - t
        n_ours = meta["splits"]["train"]["tokens"]
        ours.append(n_ours / dt)
    med = statistics.median
    return {
        "documents": len(docs),
        "characters": sum(map(len, docs)),
        "tokens": n_ours,
        "plain_encode_batch_tokens_per_s": med(plain),
        "plain_shard_writer_tokens_per_s": med(plain_writer),
        "doel_prepare_tokens_per_s": med(ours),
        "ratio": med(ours) / med(plain),
        "ratio_vs_plain_shard_writer": med(ours) / med(plain_writer),
        "repeats": repeats,
        "note": "doel prepare reads the files, drops duplicates and writes shards with headers "
        "and meta.json; the plain shard writer reads the files, calls encode_batch and writes "
        "the ids; plain encode_batch only encodes documents already in memory",
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--bangla-share", type=float, default=0.55)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = Path(args.data)
    if not (data / "splits.json").is_file():
        sys.exit(f"no {data}/splits.json: point --data at the shared data folder")
    splits = json.loads((data / "splits.json").read_text())
    train_paths = [str(data / p) for p in splits["bn"]["train"] + splits["en"]["train"]]
    sources = resolve_sources(train_paths)
    mixed = language_weights(sources, len(splits["bn"]["train"]), args.bangla_share)
    val = {
        lang: [
            d
            for s in resolve_sources([str(data / p) for p in splits[lang]["validation"]])
            for d in iter_source(s)
        ]
        for lang in ("bn", "en")
    }

    results, work = {}, Path(tempfile.mkdtemp())
    trained = {
        "doel": ("doel", mixed),
        "doel, byte-level BPE": ("doel-bytelevel", mixed),
        "plain fix (GPT-4 split + \\p{M}), byte-level": ("marks-bytelevel", mixed),
        "doel, natural mix (no weights)": ("doel", None),
        "GPT-2-style byte-level BPE (same data)": ("gpt2", mixed),
    }
    for i, (name, (style, weights)) in enumerate(trained.items()):
        t = time.perf_counter()
        cfg = TokenizerConfig(vocab_size=args.vocab_size, style=style)
        path = train_tokenizer(sources, cfg, work / str(i), weights, progress=False)
        results[name] = measure(load_any(path), val)
        results[name] |= {
            "trained_here": True,
            "style": style,
            "train_seconds": round(time.perf_counter() - t, 1),
            "vocab_size": args.vocab_size,
        }
        print(
            f"{name}: bn {results[name]['bn']['chars_per_token']:.3f} "
            f"en {results[name]['en']['chars_per_token']:.3f}",
            flush=True,
        )
    for name, rel in REFERENCES.items():
        tok = load_any(data / "tokenizers" / rel)
        results[name] = measure(tok, val) | {
            "trained_here": False,
            "file": rel,
            "vocab_size": tok.vocab_size,
        }
    # Shard writing on the whole corpus (the target): at a few MB, prepare's fixed costs
    # (loading the tokenizer, fsync, meta.json) are a tenth of a one-second run, which a
    # corpus worth sharding never sees. The small set is kept beside it for comparison.
    every = [str(data / p) for lang in ("bn", "en") for part in splits[lang].values() for p in part]
    small = [
        str(data / p)
        for p in splits["bn"]["validation"] + splits["en"]["validation"] + splits["en"]["train"][:1]
    ]
    speed = throughput(work / "0" / "tokenizer.json", every, args.repeats)
    speed_small = throughput(work / "0" / "tokenizer.json", small, args.repeats)
    ours = results["doel"]
    report = {
        "date": date.today().isoformat(),
        "machine": machine(python=True),
        "bangla_share_of_training_characters": args.bangla_share,
        "tokenizers": results,
        "throughput": speed,
        "throughput_small_corpus": speed_small,
        "targets": TARGETS,
        "met": {
            "bn_chars_per_token": ours["bn"]["chars_per_token"] >= TARGETS["bn_chars_per_token"],
            "en_chars_per_token": ours["en"]["chars_per_token"] >= TARGETS["en_chars_per_token"],
            "bn_byte_fallback": ours["bn"]["byte_fallback_rate"] < TARGETS["bn_byte_fallback"],
            "shards_at_least_as_fast_as_plain_encode_batch": speed["ratio"] >= 1.0,
            "shards_at_least_as_fast_as_plain_shard_writer": (
                speed["ratio_vs_plain_shard_writer"] >= 1.0
            ),
        },
    }
    publish(args.out, "tokenizer", report, markdown(report), figure(report))


def _tpw(x: dict) -> str:
    """Tokens per word; results written before it was measured have words/token only."""
    tpw = x.get("tokens_per_word") or (1 / x["words_per_token"] if x["words_per_token"] else None)
    return f"{tpw:.3f}" if tpw else "n/a"


def markdown(r: dict) -> str:
    lines = [
        *heading("Tokenizer benchmark", r),
        "Characters per token and tokens per word (whitespace-separated) on the validation "
        "split of `../shared/data/splits.json` (Bangla: Bengali-script text of the bn files; "
        "English: Latin-script text of the en files). Tokenizers marked * were trained here at "
        f"{r['tokenizers']['doel']['vocab_size']:,} tokens on the train split, Bangla "
        f"{r['bangla_share_of_training_characters']:.0%} of the training characters "
        "(except the natural mix).",
        "",
        "| tokenizer | vocab | bn chars/token | en chars/token | bn/en | bn tokens/word "
        "| en tokens/word | bn byte fallback | bn partial-char tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in r["tokenizers"].items():
        star = "*" if t["trained_here"] else ""
        lines.append(
            f"| {name}{star} | {t['vocab_size']:,} | {t['bn']['chars_per_token']:.3f} | "
            f"{t['en']['chars_per_token']:.3f} | {t['bn_over_en']:.2f} | "
            f"{_tpw(t['bn'])} | {_tpw(t['en'])} | "
            f"{t['bn']['byte_fallback_rate']:.3%} | {t['bn']['partial_char_rate']:.3%} |"
        )
    m = r["met"]
    for key, what in (
        ("throughput", "the whole corpus (the target)"),
        ("throughput_small_corpus", "the validation files and one more"),
    ):
        if key not in r:
            continue
        s = r[key]
        lines += [
            "",
            f"Shard writing on {what}: {s['characters']:,} characters ({s['tokens']:,} tokens), "
            f"median of {s['repeats']}, 2 cores: doel prepare "
            f"{s['doel_prepare_tokens_per_s']:,.0f} tokens/s; a plain-library shard writer "
            f"{s['plain_shard_writer_tokens_per_s']:,.0f} tokens/s (ratio "
            f"**{s['ratio_vs_plain_shard_writer']:.2f}**); bare `Tokenizer.encode_batch` on "
            f"documents in memory {s['plain_encode_batch_tokens_per_s']:,.0f} tokens/s (ratio "
            f"**{s['ratio']:.2f}**).",
        ]
    lines += [
        "",
        r["throughput"]["note"] + ".",
        "",
        "Targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in m.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def figure(r: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["tokenizers"])
    bn = [r["tokenizers"][n]["bn"]["chars_per_token"] for n in names]
    en = [r["tokenizers"][n]["en"]["chars_per_token"] for n in names]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], bn, height=0.4, label="Bangla", color="#c0392b")
    ax.barh([i - 0.2 for i in y], en, height=0.4, label="English", color="#2c3e50")
    ax.set_yticks(list(y), [n + ("*" if r["tokenizers"][n]["trained_here"] else "") for n in names])
    ax.invert_yaxis()
    ax.axvline(4.4, ls="--", color="#c0392b", lw=1)
    ax.axvline(4.0, ls=":", color="#2c3e50", lw=1)
    ax.set_xlabel("characters per token on held-out text (higher is better)")
    ax.set_title(f"Tokenizer fairness, {r['date']} (* trained here at 32,768 tokens)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.set_dpi(110)
    return fig  # written by report.publish


if __name__ == "__main__":
    main()
