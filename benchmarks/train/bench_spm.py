"""Which tokenizer style should be the default: llama.cpp-compatible candidates against doel's.

Issue 32: on ../shared/data, by characters per token and by what a model learns.

1. Tokenizers of each style in STYLES, trained on the same first --max-chars characters of the
   train split of splits.json (Bangla --bangla-share of them), at 8,192 and 32,768 tokens.
2. Characters per token and tokens per word on the validation split, NFC (as prepare gives text
   to every model): per script, as benchmarks/results/tokenizer.md counts them (runs of one
   script, each encoded alone), and per language on whole documents (the text a model reads).
3. Bits per character on the validation split of the same small Llama trained on each style's
   --model-vocab tokenizer: same data, same steps, same tokens a step, --seeds seeds each.
4. llama.cpp parity of the spm style at the largest size (benchmarks/export/bench_gguf.py's proof:
   every validation line and blocks of 20 lines, Bangla and English, and f32 logits), and the
   prompt llama_cpp's create_chat_completion renders from the GGUF's template against
   doel-serve's ids for the same conversation.

The decision rule (issue 32): a llama.cpp-compatible style becomes the default if it keeps
>= 0.97x doel's Bangla and English characters per token at 32,768 and its bits per character are
no worse than doel's beyond the seeds' spread.

Writes benchmarks/results/spm.{json,md}. Run: `python -m benchmarks.train.bench_spm`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import doel.train.data.tokenizer as tokmod
from benchmarks.common.report import heading, load_line, parser, publish, stamp
from benchmarks.export.bench_gguf import parity_table
from benchmarks.train.bench_tokenizer import language_weights, measure
from doel.train.data.fertility import load_any
from doel.train.data.textio import iter_source, resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

RESULTS = ("spm",)

ROOT = Path(__file__).resolve().parents[2]
# GPT-4o's published split (o200k), which llama.cpp runs as its "gpt4o" pre-type: combining
# marks (\p{M}) in its letter classes, like qwen35's.
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> TokenizerConfig fields. "gpt4o split" is a benchmark-only style (patched in): the
# gguf style's training over characters with byte fallback, with GPT-4o's split; measured on
# NFC text, its NFC normalizer changes nothing there.
STYLES = {
    "doel": {"style": "doel"},
    "spm": {"style": "spm", "nfc_text": False},
    "spm, NFC text": {"style": "spm", "nfc_text": True},
    "gguf (qwen35)": {"style": "gguf"},
    "gpt4o split": {"style": "gpt4o"},
}
LLAMA_CPP = ("spm", "spm, NFC text", "gguf (qwen35)", "gpt4o split")


@contextlib.contextmanager
def style_available(style: str):
    """TokenizerConfig(style="gpt4o") trains for the block."""
    if style != "gpt4o":
        yield
        return
    tokmod.PATTERNS["gpt4o"], tokmod.STYLES["gpt4o"] = GPT4O, ("gpt4o", False)
    try:
        yield
    finally:
        del tokmod.PATTERNS["gpt4o"], tokmod.STYLES["gpt4o"]


def train_all(sources, weights, sizes, max_chars, work: Path) -> dict[str, dict[int, Path]]:
    """Every style at every size: {name: {size: tokenizer.json}} (kept in `work`)."""
    out: dict[str, dict[int, Path]] = {}
    for i, (name, fields) in enumerate(STYLES.items()):
        for size in sizes:
            folder = work / f"tok-{i}-{size}"
            path = folder / "tokenizer.json"
            if not path.is_file():
                t = time.perf_counter()
                with style_available(fields["style"]):
                    cfg = TokenizerConfig(vocab_size=size, max_chars=max_chars, **fields)
                    train_tokenizer(sources, cfg, folder, weights, progress=False)
                print(f"{name} {size}: trained in {time.perf_counter() - t:.0f} s", flush=True)
            out.setdefault(name, {})[size] = path
    return out


def whole_documents(path: Path, val: dict[str, list[str]]) -> dict:
    """Characters and words per token of each language's documents, encoded whole."""
    tok = load_tokenizer(path)
    out = {}
    for lang, docs in val.items():
        tokens = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
        chars, words = sum(map(len, docs)), sum(len(d.split()) for d in docs)
        out[lang] = {
            "characters": chars,
            "tokens": tokens,
            "chars_per_token": chars / tokens,
            "tokens_per_word": tokens / words,
        }
    return out


def counts(paths: dict[str, dict[int, Path]], val: dict[str, list[str]], script: bool) -> dict:
    """Per style and size: the whole-document measures (and with `script` the per-script ones:
    minutes more on a loaded 2-core machine), and each against doel."""
    out: dict = {}
    kinds = ("whole", "script") if script else ("whole",)
    for name, by_size in paths.items():
        for size, path in by_size.items():
            row = {"whole": whole_documents(path, val)}
            if script:
                row["script"] = measure(load_any(path), val)
            out.setdefault(str(size), {})[name] = row
    for rows in out.values():
        for row in rows.values():
            for kind in kinds:
                for lang in ("bn", "en"):
                    ref = rows["doel"][kind][lang]["chars_per_token"]
                    row[kind][lang]["vs_doel"] = row[kind][lang]["chars_per_token"] / ref
    return out


def model_runs(paths, size, train_docs, val, seeds, steps, styles) -> dict:
    """Bits per character of the small model (bits_per_char) on each of `styles`."""
    out = {}
    for name in styles:
        by_size = paths[name]
        runs = []
        for seed in range(seeds):
            t = time.perf_counter()
            r = bits_per_char(by_size[size], train_docs, val, seed, steps)
            r["seconds"] = round(time.perf_counter() - t, 1)
            runs.append(r)
            print(f"{name} seed {seed}: {json.dumps(r)}", flush=True)
        out[name] = {"runs": runs} | {
            f"{lang}_bits_per_char": [r[lang]["bits_per_char"] for r in runs]
            for lang in ("bn", "en", "all")
        }
    return out


# The small model: 4 layers x 128, 128-token windows, 16 a step. On this project's 2-core CPU
# a run of 300 steps takes about 2 minutes (the seconds are in the results).
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
BATCH, LR = 16, 3e-3


def _stream(tok, docs: list[str]):
    """Every document's ids with <|bos|> in front, joined: one long int64 tensor."""
    import torch

    ids = [i for e in tok.encode_batch(docs) for i in e.ids]
    return torch.tensor(ids, dtype=torch.long)


def bits_per_char(path: Path, train_docs, val, seed: int, steps: int) -> dict:
    """Train the small model on `train_docs` for `steps` steps of BATCH random windows; its
    bits per character on each language's validation documents (every token after the first
    scored, in windows of the model's context)."""
    import torch

    from doel.train.model import Llama, ModelConfig

    tok = load_tokenizer(path)
    T = MODEL["max_position_embeddings"]
    data = _stream(tok, train_docs)
    torch.manual_seed(seed)
    model = Llama(ModelConfig(vocab_size=tok.get_vocab_size(), **MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for g in opt.param_groups:  # warm up 20 steps, then cosine to a tenth
            warm = min(1.0, (step + 1) / 20)
            g["lr"] = LR * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        at = torch.randint(0, len(data) - T - 1, (BATCH,), generator=gen)
        x = torch.stack([data[i : i + T] for i in at])
        y = torch.stack([data[i + 1 : i + T + 1] for i in at])
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    out, total = {"train_loss_last": round(loss.item(), 4)}, [0.0, 0]
    for lang, docs in val.items():
        ids = _stream(tok, docs)  # every token scored: windows of T, the last one shorter
        x, y = ids[:-1].split(T), ids[1:].split(T)
        with torch.no_grad():
            nats = sum(model(a[None], b[None], "sum").item() for a, b in zip(x, y))
        chars = sum(map(len, docs))
        out[lang] = {"tokens": len(ids), "characters": chars,
                     "bits_per_char": nats / math.log(2) / chars}  # fmt: skip
        total[0] += nats
        total[1] += chars
    out["all"] = {"bits_per_char": total[0] / math.log(2) / total[1]}
    return out


def chat_prompt(tok_path: Path, work: Path) -> dict:
    """The ids llama_cpp's create_chat_completion tokenizes from the GGUF's template, against
    doel-serve's ChatTemplate for the same conversation (a Bangla and an English turn)."""
    import llama_cpp

    from doel.serve.core.template import ChatTemplate

    gguf = next((work / "proof" / "gguf").glob("*.gguf"))
    llm = llama_cpp.Llama(str(gguf), n_ctx=512, verbose=False)
    seen = []
    real = llm.tokenize

    def spy(text, add_bos=True, special=False):
        ids = real(text, add_bos=add_bos, special=special)
        seen.append(ids)
        return ids

    llm.tokenize = spy
    messages = [
        {"role": "system", "content": "তুমি একজন সহায়ক।"},
        {"role": "user", "content": "আমার সোনার বাংলা, কেমন আছ?\nAnd  in English?"},
    ]
    llm.create_chat_completion(messages=messages, max_tokens=1, temperature=0.0)
    theirs = seen[0]
    ours = ChatTemplate.load(tok_path.parent).ids(messages)
    return {"identical": ours == theirs, "tokens": len(ours), "llama_cpp": theirs[:8]}


def decide(result: dict) -> dict:
    """The issue's rule for each llama.cpp style, on whole documents at the largest size: both
    languages at >= 0.97x doel's characters per token, and mean bits per character not above
    doel's by more than the larger of the two styles' seed ranges."""
    size = max(result["counts"], key=int)
    rows, models = result["counts"][size], result.get("models", {})
    out = {}
    for name in LLAMA_CPP:
        ratios = {lang: rows[name]["whole"][lang]["vs_doel"] for lang in ("bn", "en")}
        verdict = {"chars_per_token": ratios, "counts_ok": min(ratios.values()) >= 0.97}
        if name in models and "doel" in models:
            a, b = models[name]["all_bits_per_char"], models["doel"]["all_bits_per_char"]
            spread = max(max(a) - min(a), max(b) - min(b))
            diff = sum(a) / len(a) - sum(b) / len(b)
            verdict |= {"bits_per_char_diff": diff, "spread": spread, "bpc_ok": diff <= spread}
        # None: its bits per character were not measured, so the rule cannot pass it.
        verdict["passes"] = verdict["counts_ok"] and verdict.get("bpc_ok")
        out[name] = verdict
    return out


def markdown(r: dict) -> str:
    out = heading("Tokenizer styles for llama.cpp: cost and what a model learns", r)
    out += [
        f"{r['cpu']['model_name']}, {r['load_start']} → {r['load_end']} (shared "
        f"machine). Tokenizers trained on the first {r['max_chars']:,} characters of the train "
        f"split of `../shared/data/splits.json` (Bangla {r['bangla_share']:.0%}); measured on "
        "its validation split, NFC (as prepare gives text to a model).",
        "",
        "Characters per token (and tokens per word), whole documents of each language"
        + (
            "; in brackets the per-script count of benchmarks/results/tokenizer.md (runs of one "
            "script encoded alone: the spm styles pay a '▁' where a run starts with a space):"
            if "script" in next(iter(next(iter(r["counts"].values())).values()))
            else ":"
        ),
        "",
        "| vocab | style | bn chars/token | bn vs doel | bn tokens/word | en chars/token "
        "| en vs doel | en tokens/word |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size, rows in r["counts"].items():
        for name, row in rows.items():
            cells = []
            for lang in ("bn", "en"):
                w, s = row["whole"][lang], row.get("script", {}).get(lang)
                cells += [
                    f"{w['chars_per_token']:.3f}" + (f" ({s['chars_per_token']:.3f})" if s else ""),
                    f"{w['vs_doel']:.3f}x" + (f" ({s['vs_doel']:.3f}x)" if s else ""),
                    f"{w['tokens_per_word']:.3f}",
                ]
            out.append(f"| {int(size):,} | {name} | " + " | ".join(cells) + " |")
    m = r.get("models")
    if m:
        out += [
            "",
            f"Bits per character on the validation split (first {r['model_val_chars']:,} "
            f"characters of each language) of a Llama of {MODEL['num_hidden_layers']} layers x "
            f"{MODEL['hidden_size']} trained on each style's {r['model_vocab']:,}-token "
            f"tokenizer: {r['steps']} steps of {BATCH} x {MODEL['max_position_embeddings']} "
            f"tokens from the same {r['model_chars']:,} training characters, seeds "
            f"{', '.join(map(str, range(r['seeds'])))} (each value one seed):",
            "",
            "| style | bn bits/char | en bits/char | all bits/char | seconds a run |",
            "|---|---|---|---|---:|",
        ]
        for name, x in m.items():
            cells = [" / ".join(f"{v:.4f}" for v in x[f"{k}_bits_per_char"])
                     for k in ("bn", "en", "all")]  # fmt: skip
            secs = sum(run["seconds"] for run in x["runs"]) / len(x["runs"])
            out.append(f"| {name} | " + " | ".join(cells) + f" | {secs:.0f} |")
    out += ["", "Decision rule (issue 32), whole documents at the largest vocabulary:", ""]
    out += ["| style | bn | en | bits/char vs doel | seeds' spread | becomes default? |"]
    out += ["|---|---:|---:|---:|---:|---|"]
    for name, v in r["decision"].items():
        c = v["chars_per_token"]
        d = f"{v['bits_per_char_diff']:+.4f}" if "bits_per_char_diff" in v else "not run"
        sp = f"{v['spread']:.4f}" if "spread" in v else ""
        verdict = {True: "yes", False: "no", None: "no (bits/char not measured)"}[v["passes"]]
        out.append(f"| {name} | {c['bn']:.3f}x | {c['en']:.3f}x | {d} | {sp} | {verdict} |")
    p = r.get("proof")
    if p:
        size = int(max(r["counts"], key=int))
        out += [
            "",
            f"llama.cpp (llama-cpp-python {p['llama_cpp']}) against `tokenizers` on the "
            f"{r['proof_style']} tokenizer at {size:,} tokens (a random 2-layer Llama on it, "
            "`doel-export --format gguf --quant f32`):",
            "",
        ]
        out += parity_table(p)
        lg = p["logits"]
        out += ["", f"f32 logits on a {lg['positions']}-token held-out prompt: max |llama.cpp - "
                f"PyTorch| = {lg['relative']:.2e} of the largest logit (bound {lg['bound']:.0e}"
                f": {'ok' if lg['relative'] <= lg['bound'] else 'over'})."]  # fmt: skip
        c = r["chat"]
        out += ["", f"create_chat_completion's prompt from the GGUF's template, {c['tokens']} "
                f"tokens: {'the same ids as' if c['identical'] else 'NOT the ids of'} "
                "doel-serve's chat template."]  # fmt: skip
    return "\n".join(out) + "\n"


def _data(args):
    """(train sources, weights, validation documents NFC, model training documents NFC)."""
    from doel.train.data.tokenizer import mix_documents

    data = Path(args.data)
    if not (data / "splits.json").is_file():
        sys.exit(f"no {data}/splits.json: point --data at the shared data folder")
    splits = json.loads((data / "splits.json").read_text())
    sources = resolve_sources(
        [str(data / p) for p in splits["bn"]["train"] + splits["en"]["train"]]
    )
    weights = language_weights(sources, len(splits["bn"]["train"]), args.bangla_share)
    nfc = lambda t: unicodedata.normalize("NFC", t)  # noqa: E731
    val = {
        lang: [nfc(d) for s in resolve_sources([str(data / p) for p in splits[lang]["validation"]])
               for d in iter_source(s)]
        for lang in ("bn", "en")
    }  # fmt: skip
    docs = [nfc(d[:10_000]) for _, d in mix_documents(sources, weights, max_chars=args.model_chars)]
    return sources, weights, val, docs


def _head(docs: list[str], chars: int) -> list[str]:
    out, n = [], 0
    for d in docs:
        if n >= chars:
            break
        out.append(d[: chars - n])
        n += len(out[-1])
    return out


def main() -> None:
    ap = parser(__doc__, work="scratch folder: tokenizers and finished model runs are reused")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--vocab-size", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--max-chars", type=int, default=4_000_000, help="tokenizer training text")
    ap.add_argument("--bangla-share", type=float, default=0.55)
    ap.add_argument("--model-vocab", type=int, default=8192)
    ap.add_argument("--model-chars", type=int, default=3_000_000, help="model training text")
    ap.add_argument("--model-val-chars", type=int, default=200_000, help="per language")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--model-styles", nargs="+", choices=list(STYLES), help="default: all")
    ap.add_argument("--no-script", action="store_true", help="whole documents only")
    ap.add_argument("--render", action="store_true", help="rewrite OUT/spm.md from OUT/spm.json")
    args = ap.parse_args()
    if args.render:
        r = json.loads((args.out / "spm.json").read_text())
        r["decision"] = decide(r)
        publish(args.out, "spm", r, markdown(r))
        return
    work = Path(args.work or Path(tempfile.gettempdir()) / "bench-spm")
    work.mkdir(parents=True, exist_ok=True)
    sources, weights, val, docs = _data(args)
    r = stamp() | {k: getattr(args, k) for k in ("max_chars", "bangla_share", "model_vocab",
                                                  "model_chars", "model_val_chars", "steps",
                                                  "seeds")}  # fmt: skip
    r["load_start"] = load_line("at the start")
    paths = train_all(sources, weights, args.vocab_size, args.max_chars, work)
    r["counts"] = counts(paths, val, not args.no_script)
    if not args.skip_model:
        mval = {lang: _head(d, args.model_val_chars) for lang, d in val.items()}
        styles = args.model_styles or list(STYLES)
        r["models"] = model_runs(
            paths, args.model_vocab, docs, mval, args.seeds, args.steps, styles
        )
    r["decision"] = decide(r)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: parity not run", flush=True)
    else:
        from benchmarks.export.bench_gguf import proof

        r["proof_style"] = "spm, NFC text"
        tok = paths[r["proof_style"]][max(args.vocab_size)]
        lines = {lang: [ln for d in v for ln in d.splitlines() if ln.strip()]
                 for lang, v in val.items()}  # fmt: skip
        for lang in ("bn", "en"):  # newlines and blank lines too: blocks of 20 lines
            raw = [ln for d in val[lang] for ln in d.split("\n")]
            lines[f"{lang}, blocks of 20 lines"] = ["\n".join(raw[i : i + 20])
                                                   for i in range(0, len(raw), 20)]  # fmt: skip
        r["proof"] = proof(tok, lines, work / "proof")
        r["chat"] = chat_prompt(tok, work)
    r["load_end"] = load_line()
    publish(args.out, "spm", r, markdown(r))


if __name__ == "__main__":
    main()
