"""Which grammar engine enforces response_format: llguidance, xgrammar and outlines-core.

Decided (issue 35): llguidance (serve/core/structured.py); the evidence is
benchmarks/results/grammar_engines_cpu-<class>.md, kept runnable and not run in CI. The engines
run on doel's default tokenizer (spm: SentencePiece BPE with byte-fallback `<0xNN>` tokens) at
the 0.4B model's 32,768 tokens.

For each engine: the tokenizer's set-up time; a schema's compile time (five schemas, each compiled
cold); the time of one token mask at 1 row and of 8 rows' masks in one step, along random valid
walks through the schemas; and whether it handles the byte-fallback vocabulary: the tokenizer's
own ids of valid Bangla documents, and the same documents spelled in `<0xNN>` byte tokens only,
must both be accepted, and random walks (which pick byte tokens half the time where allowed) must
end in documents that parse and keep their Bangla. An engine that needs torch is noted: serve
has none.

xgrammar and outlines-core are not doel dependencies: give an interpreter that has them (and
numpy, tokenizers) with --engine-python; each engine runs in a process of its own.

    python -m benchmarks.probes.probe_grammar --engine-python /tmp/geng/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = ("grammar_engines_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 32768
ENGINES = ("llguidance", "xgrammar", "outlines-core")
CITIES = ["ঢাকা", "চট্টগ্রাম", "খুলনা", "রাজশাহী", "Sylhet"]
SCHEMAS = {
    "enum + integer": {
        "type": "object",
        "properties": {"city": {"enum": CITIES}, "n": {"type": "integer"}},
        "required": ["city", "n"],
        "additionalProperties": False,
    },
    "Bangla string": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "nested array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"k": {"enum": CITIES}, "v": {"type": "number"}},
                    "required": ["k"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "any object": {"type": "object"},
}
# Valid documents written as the engines' JSON (", " and ": ", no other whitespace).
DOCS = {
    "enum + integer": {"city": "চট্টগ্রাম", "n": 42},
    "Bangla string": {"name": "নদী ও মাঠ", "ok": True},
    "nested array": {"items": [{"k": "রাজশাহী", "v": 1.5}, {"k": "Sylhet"}]},
    "pattern": {"code": "BD-123"},
}


def byte_of(piece: str) -> int | None:
    return int(piece[3:5], 16) if len(piece) == 6 and piece[:3] == "<0x" else None


class Engine:
    """The few calls the probe makes; one subclass per engine."""

    def __init__(self, tok_json: str):
        data = json.loads(tok_json)
        self.specials = {a["id"] for a in data["added_tokens"]}
        self.pieces = {i: t for t, i in data["model"]["vocab"].items()}
        self.eos = data["model"]["vocab"].get("<|eos|>", 1)
        self.bytes_ids = {b: i for i, t in self.pieces.items() if (b := byte_of(t)) is not None}

    def token_bytes(self, i: int) -> bytes:
        t = self.pieces.get(i, "")
        b = byte_of(t)
        return bytes([b]) if b is not None else t.replace("▁", " ").encode()


class LLGuidance(Engine):
    def __init__(self, tok_json: str):
        super().__init__(tok_json)
        import llguidance
        import llguidance.numpy as llnp

        self.ll, self.np = llguidance, llnp
        self.tok = llguidance.LLTokenizer(tok_json, n_vocab=VOCAB, eos_token=self.eos)
        self.executor = llguidance.LLExecutor(2)

    def compile(self, schema: dict):
        opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        g = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=opts)
        m = self.ll.LLMatcher(self.tok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bits, row=0):
        self.np.fill_next_token_bitmask(m, bits, row)

    def fill_batch(self, ms, bits):
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bits)

    def consume(self, m, t: int) -> bool:
        return m.consume_token(t)

    def accepting(self, m) -> bool:
        return m.is_accepting()


class XGrammar(Engine):
    def __init__(self, tok_json: str):
        super().__init__(tok_json)
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        vocab = [self.pieces.get(i, "") for i in range(len(self.pieces))]
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.BYTE_FALLBACK, vocab_size=VOCAB, stop_token_ids=[self.eos],
            add_prefix_space=False,
        )  # fmt: skip
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bits, row=0):
        m.fill_next_token_bitmask(self.torch.from_numpy(bits), row)

    def fill_batch(self, ms, bits):
        self.batch.batch_fill_next_token_bitmask(ms, self.torch.from_numpy(bits))

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)

    def accepting(self, m) -> bool:
        return m.is_completed() if hasattr(m, "is_completed") else m.is_terminated()


class OutlinesCore(Engine):
    def __init__(self, tok_json: str):
        super().__init__(tok_json)
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.regex = oc, build_regex_from_schema
        vocab: dict[bytes, list[int]] = {}
        for i in self.pieces:
            if i not in self.specials:
                vocab.setdefault(self.token_bytes(i), []).append(i)
        self.vocab = oc.Vocabulary(self.eos, vocab)

    def compile(self, schema: dict):
        # Its JSON has no whitespace option: the pattern is the schema's with one optional
        # whitespace between tokens (the documents below are written with ", " and ": ").
        return self.oc.Index(self.regex(json.dumps(schema), r"[ ]?"), self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bits, row=0):
        v = bits[row]
        m.write_mask_into(v.ctypes.data, v.size, v.itemsize)

    def fill_batch(self, ms, bits):
        for i, m in enumerate(ms):  # no batch call
            self.fill(m, bits, i)

    def consume(self, m, t: int) -> bool:
        try:
            m.advance(t)
            return True
        except Exception:  # its refusal of a token the index does not allow
            return False

    def accepting(self, m) -> bool:
        return m.is_finished() or self.eos in m.get_tokens()


CLASSES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def allowed(bits: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), count=VOCAB, bitorder="little"))


def walk(e: Engine, compiled, rng, limit: int = 150):
    """A random valid walk (byte tokens preferred half the time): (ids, ended, mask seconds)."""
    m, bits, ids, times = e.matcher(compiled), np.zeros((1, VOCAB // 32), np.int32), [], []
    byte_ids = np.array(sorted(e.bytes_ids.values()))
    for _ in range(limit):
        t = time.perf_counter()
        e.fill(m, bits)
        times.append(time.perf_counter() - t)
        a = allowed(bits[0])
        if e.eos in a and (len(a) == 1 or rng.random() < 0.3):
            return ids, True, times
        a = a[(a != e.eos) & ~np.isin(a, list(e.specials))]
        if not len(a):
            return ids, e.accepting(m), times
        b = a[np.isin(a, byte_ids)]
        pick = int(rng.choice(b) if len(b) and rng.random() < 0.5 else rng.choice(a))
        if not e.consume(m, pick):
            return ids, False, times
        ids.append(pick)
    return ids, False, times


def spellings(e: Engine, tok, text: str) -> dict[str, list[int]]:
    """The tokenizer's own ids of `text` (its dummy-prefix space taken off) and its bytes as
    `<0xNN>` tokens."""
    ids = tok.encode(text, add_special_tokens=False).ids
    first = e.token_bytes(ids[0])
    if first.startswith(b" "):
        rest = first[1:].decode("utf-8", "replace")
        fix = [i for i, p in e.pieces.items() if p == rest and i not in e.specials]
        ids = ids[1:] if not rest else fix[:1] + ids[1:] if fix else [
            e.bytes_ids[b] for b in first[1:]] + ids[1:]  # fmt: skip
    assert b"".join(map(e.token_bytes, ids)) == text.encode(), text
    return {"tokenizer ids": ids, "byte tokens only": [e.bytes_ids[b] for b in text.encode()]}


def probe_one(name: str, tok_path: str, seed: int = 0) -> dict:
    from tokenizers import Tokenizer

    tok_json = Path(tok_path).read_text(encoding="utf-8")
    t = time.perf_counter()
    e = CLASSES[name](tok_json)
    out = {"engine": name, "tokenizer_setup_ms": (time.perf_counter() - t) * 1e3}
    out["needs_torch"] = "torch" in sys.modules
    tok, rng = Tokenizer.from_str(tok_json), np.random.default_rng(seed)
    out["compile_ms"], out["accepts"], compiled = {}, {}, {}
    for label, schema in SCHEMAS.items():
        times = []
        for _ in range(3):
            t = time.perf_counter()
            compiled[label] = e.compile(schema)
            times.append((time.perf_counter() - t) * 1e3)
        out["compile_ms"][label] = float(np.median(times))
    for label, doc in DOCS.items():
        text = json.dumps(doc, ensure_ascii=False, separators=(", ", ": "))
        for how, ids in spellings(e, tok, text).items():
            m = e.matcher(compiled[label])
            ok = all(e.consume(m, i) for i in ids) and e.accepting(m)
            out["accepts"][f"{label}: {how}"] = bool(ok)
    out |= walks(e, compiled, rng)
    out["batch8_ms"] = batch8(e, compiled, rng)
    return out


def walks(e: Engine, compiled: dict, rng, per_schema: int = 30) -> dict:
    """Random walks: mask times at 1 row, and whether every ended walk parses with its Bangla."""
    first, later, ended, valid, byte_tokens, bad = [], [], 0, 0, 0, []
    for label, c in compiled.items():
        for _ in range(per_schema):
            ids, done, times = walk(e, c, rng)
            first.append(times[0])
            later += times[1:]
            byte_tokens += sum(i in e.bytes_ids.values() for i in ids)
            if done:
                ended += 1
                raw = b"".join(map(e.token_bytes, ids))
                try:
                    doc = json.loads(raw.decode("utf-8"))
                    ok = isinstance(doc, dict) and doc.get("city", CITIES[0]) in CITIES
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    ok, why = False, f"{type(err).__name__}: {err}"
                else:
                    why = "a city outside the enum"
                valid += ok
                if not ok and len(bad) < 3:
                    bad.append({"schema": label, "bytes": repr(raw[:160]), "why": why[:160]})
    ms = np.array(later) * 1e3
    return {
        "mask_ms_first": float(np.median(first) * 1e3),
        "mask_ms_median": float(np.median(ms)),
        "mask_ms_p99": float(np.percentile(ms, 99)),
        "walks_ended": ended,
        "walks_valid": int(valid),
        "walk_byte_tokens": int(byte_tokens),
        "invalid_examples": bad,
    }


def batch8(e: Engine, compiled: dict, rng, steps: int = 60) -> float:
    """Median time of one step's 8 masks (each row at its own place in its own schema)."""
    labels = list(compiled)
    rows = [e.matcher(compiled[labels[i % len(labels)]]) for i in range(8)]
    bits, times = np.zeros((8, VOCAB // 32), np.int32), []
    for _ in range(steps):
        t = time.perf_counter()
        e.fill_batch(rows, bits)
        times.append(time.perf_counter() - t)
        for i, m in enumerate(rows):
            a = allowed(bits[i])
            a = a[(a != e.eos) & ~np.isin(a, list(e.specials))]
            if not len(a) or not e.consume(m, int(rng.choice(a))):
                rows[i] = e.matcher(compiled[labels[i % len(labels)]])
    return float(np.median(times) * 1e3)


def spm_tokenizer(data: Path, work: Path, max_chars: int) -> Path:
    """doel's default tokenizer (spm) at 32,768 tokens, trained on the shared train split once
    and kept in `work`."""
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    path = work / f"spm-{VOCAB}" / "tokenizer.json"
    if path.is_file():
        return path
    if not (data / "splits.json").is_file():
        sys.exit(
            f"no {data}/splits.json: point --data at the shared data folder, or give --tokenizer"
        )
    splits = json.loads((data / "splits.json").read_text(encoding="utf-8"))
    files = [str(data / p) for lang in ("bn", "en") for p in splits[lang]["train"]]
    cfg = TokenizerConfig(vocab_size=VOCAB, max_chars=max_chars)
    print(f"training the spm tokenizer ({VOCAB:,} tokens) ...", flush=True)
    train_tokenizer(resolve_sources(files), cfg, path.parent, progress=False)
    return path


def run_engine(name: str, python: str, tok: Path) -> dict:
    """One engine in a process of its own (its imports and threads do not meet the others')."""
    cmd = [python, "-m", "benchmarks.probes.probe_grammar", "--one", name, "--tokenizer", str(tok)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"engine": name, "error": lines[-1][:300] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verdict(rows: list[dict]) -> tuple[str | None, list[str]]:
    """The engine chosen: torch-free (serve has no torch), every Bangla spelling accepted, every
    ended walk valid; then the fastest to compile the slowest schema (masks are all far below a
    0.4B decode step)."""
    why, fit = [], []
    for r in rows:
        if "error" in r:
            why.append(f"{r['engine']}: did not run ({r['error']})")
            continue
        bad = [k for k, ok in r["accepts"].items() if not ok]
        problems = ["needs torch, which doel-serve does not install"] if r["needs_torch"] else []
        problems += [f"refuses {', '.join(bad)}"] if bad else []
        if r["walks_valid"] < r["walks_ended"]:
            ex = r["invalid_examples"][0]["why"] if r["invalid_examples"] else ""
            problems.append(
                f"{r['walks_ended'] - r['walks_valid']} of {r['walks_ended']} ended walks are not "
                f"valid JSON ({ex})"
            )
        worst = max(r["compile_ms"].values())
        if worst > 1000:
            problems.append(f"compiles a schema in up to {worst / 1e3:.1f} s")
        (why.append(f"{r['engine']}: " + "; ".join(problems)) if problems else fit.append(r))
    best = min(fit, key=lambda r: max(r["compile_ms"].values()), default=None)
    return (best["engine"] if best else None), why


def report(r: dict) -> str:
    rows = r["engines"]
    out = [
        "# Grammar engines on doel's tokenizer (issue 35)",
        "",
        f"{r['cpu']['model_name']} ({r['cpu']['class']}), {r['cores']} cores, load "
        f"{r['load_start']:.1f} → {r['load_end']:.1f}. Tokenizer: doel's default (spm, "
        f"SentencePiece BPE with `<0xNN>` byte fallback), {VOCAB:,} tokens, trained on the shared "
        "train split. JSON without free whitespace (`, ` and `: `). Each engine in its own "
        "process; versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".",
        "",
        "| engine | tokenizer set-up ms | compile ms (worst of 5 schemas) | mask ms, 1st token "
        "| mask ms median / p99 | 8 rows' masks ms | Bangla spellings accepted | ended walks "
        "valid | torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in rows:
        if "error" in e:
            out.append(f"| {e['engine']} | did not run: {e['error']} |||||||| ")
            continue
        acc = sum(e["accepts"].values())
        out.append(
            f"| {e['engine']} | {e['tokenizer_setup_ms']:.0f} | {max(e['compile_ms'].values()):.1f}"
            f" | {e['mask_ms_first']:.3f} | {e['mask_ms_median']:.4f} / {e['mask_ms_p99']:.3f} | "
            f"{e['batch8_ms']:.3f} | {acc} / {len(e['accepts'])} | {e['walks_valid']} / "
            f"{e['walks_ended']} ({e['walk_byte_tokens']:,} byte tokens) | "
            f"{'needs it' if e['needs_torch'] else 'no'} |"
        )
    out += ["", "Compile ms per schema:", "", "| engine | " + " | ".join(SCHEMAS) + " |",
            "|---|" + "---:|" * len(SCHEMAS)]  # fmt: skip
    for e in rows:
        if "error" not in e:
            vals = " | ".join(f"{e['compile_ms'][k]:.1f}" for k in SCHEMAS)
            out.append(f"| {e['engine']} | {vals} |")
    out += ["", f"**Chosen: {r['chosen']}.**", ""] + [f"- {w}" for w in r["why_not"]]
    bad = [(e["engine"], x) for e in rows if "error" not in e for x in e["invalid_examples"]]
    if bad:
        out += ["", "Invalid documents from random walks (first few):", ""]
        out += [f"- {name}, {x['schema']}: `{x['bytes']}` — {x['why']}" for name, x in bad]
    out += ["", "Spellings: each valid document as the tokenizer's own ids and as `<0xNN>` byte "
            "tokens only; walks pick a byte token half the time where one is allowed."]  # fmt: skip
    return "\n".join(out) + "\n"


def versions(python: str) -> dict:
    code = (
        "import importlib.metadata as m, json\n"
        "v = {}\n"
        "for p in ('llguidance', 'xgrammar', 'outlines-core'):\n"
        "    try: v[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(v))"
    )
    found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(found.stdout or "{}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", choices=ENGINES, help="(internal) probe one engine, print JSON")
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: train doel's spm at 32,768)")
    data, work = ROOT.parent / "shared" / "data", Path.home() / ".cache" / "doel" / "probe-grammar"
    ap.add_argument("--data", default=str(data), help="the shared data (its train split)")
    ap.add_argument("--max-chars", type=int, default=30_000_000, help="tokenizer's characters")
    ap.add_argument("--work", default=str(work), help="where the trained tokenizer is kept")
    ap.add_argument(
        "--engine-python",
        default=sys.executable,
        help="an interpreter with xgrammar and outlines-core (not doel dependencies)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(probe_one(args.one, args.tokenizer)))
        return
    from benchmarks.common.cpu_class import this_cpu
    from benchmarks.common.report import publish

    tok = Path(args.tokenizer) if args.tokenizer else spm_tokenizer(
        Path(args.data), Path(args.work), args.max_chars)  # fmt: skip
    load_start = os.getloadavg()[0]
    rows = [
        run_engine(name, sys.executable if name == "llguidance" else args.engine_python, tok)
        for name in ENGINES
    ]
    chosen, why_not = verdict(rows)
    cpu = this_cpu()
    r = {
        "cpu": cpu, "cores": os.cpu_count(), "load_start": load_start,
        "load_end": os.getloadavg()[0], "vocab": VOCAB, "engines": rows, "chosen": chosen,
        "why_not": why_not,
        "versions": versions(sys.executable) | versions(args.engine_python),
    }  # fmt: skip
    path = publish(args.out, f"grammar_engines_cpu-{cpu['class']}", r, report(r), echo=False)
    print(f"chosen: {chosen}; wrote {path}")


if __name__ == "__main__":
    main()
