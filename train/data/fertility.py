"""Fertility report for any tokenizer: characters, bytes and words per token, and the
byte-fallback rate, per script (Bengali, Latin, other).

Text is cut into runs of one script at whitespace (punctuation and digits stay with the run
they sit in) and each run is encoded on its own, so every token is charged to one script.
A byte-fallback token stands for bytes, not characters: a byte-level token that holds no whole
character besides whitespace (only fragments of one), a SentencePiece or Llama `<0xNN>` piece,
or an unknown token. Byte-level BPE also learns tokens that end or start in the middle of a
character (" অনু" plus the first bytes of the next letter); those are counted separately as
`partial_char_rate`.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm
import tiktoken
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from doel.train.common import DoelError

SCRIPTS = ("bengali", "latin", "other")
LANGUAGE = {"bengali": "Bangla", "latin": "English", "other": "other scripts"}
_BN = re.compile("[\u0980-\u09ff]")
_LATIN = re.compile("[A-Za-z\u00c0-\u024f\u1e00-\u1eff]")
_OTHER = re.compile("(?![\u0980-\u09ff])(?![A-Za-z\u00c0-\u024f\u1e00-\u1eff])[^\\W\\d_]")
_CHUNK = re.compile(r"\s*\S+\s*$|\s*\S+")
MIN_CHARS_FOR_WARNING = 1000

# GPT-2's printable stand-ins for the 256 byte values, as the tokenizers library stores them.
_printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
_extra = [b for b in range(256) if b not in _printable]
BYTE_OF_CHAR = {chr(b): b for b in _printable} | {chr(256 + i): b for i, b in enumerate(_extra)}


@dataclass
class AnyTokenizer:
    """What the report needs from a tokenizer: plain encoding and which ids are byte fallback."""

    name: str
    vocab_size: int
    encode_batch: Callable[[list[str]], list[list[int]]]
    fallback: np.ndarray  # bool, one per id: the token stands for bytes, not characters
    partial: np.ndarray | None = None  # bool, one per id: it holds part of a character

    def __post_init__(self):
        if self.partial is None:
            self.partial = self.fallback.copy()


def script_of(chunk: str) -> str | None:
    counts = {
        "bengali": len(_BN.findall(chunk)),
        "latin": len(_LATIN.findall(chunk)),
        "other": len(_OTHER.findall(chunk)),
    }
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def script_runs(text: str) -> list[tuple[str, str, int]]:
    """Cut text into (script, run, words): whitespace-separated chunks of one script, with
    script-less chunks (numbers, punctuation) joined to the run before them."""
    runs: list[tuple[str, str, int]] = []
    for line in text.splitlines():
        cur, parts, words = None, [], 0
        for chunk in _CHUNK.findall(line):
            s = script_of(chunk) or cur or "other"
            if s != cur and parts:
                runs.append((cur, "".join(parts), words))
                parts, words = [], 0
            cur = s
            parts.append(chunk)
            words += 1
        if parts:
            runs.append((cur, "".join(parts), words))
    return runs


def fertility(tok: AnyTokenizer, texts: Iterable[str], batch: int = 2048) -> dict[str, dict]:
    """Per-script totals and ratios for the given texts."""
    totals = {
        s: dict(characters=0, bytes=0, words=0, tokens=0, fallback=0, partial=0) for s in SCRIPTS
    }
    pending: list[tuple[str, str, int]] = []

    def flush():
        encoded = tok.encode_batch([r for _, r, _ in pending])
        for (script, run, words), ids in zip(pending, encoded):
            t = totals[script]
            t["characters"] += len(run)
            t["bytes"] += len(run.encode("utf-8"))
            t["words"] += words
            t["tokens"] += len(ids)
            ids = np.asarray(ids, dtype=np.int64)
            t["fallback"] += int(tok.fallback[ids].sum())
            t["partial"] += int(tok.partial[ids].sum())
        pending.clear()

    for text in texts:
        pending.extend(script_runs(text))
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    report = {}
    for script, t in totals.items():
        if not t["characters"]:
            continue
        n = max(t["tokens"], 1)
        report[script] = {
            "characters": t["characters"],
            "tokens": t["tokens"],
            "chars_per_token": t["characters"] / n,
            "bytes_per_token": t["bytes"] / n,
            "words_per_token": t["words"] / n,
            "tokens_per_word": t["tokens"] / max(t["words"], 1),
            "byte_fallback_rate": t["fallback"] / n,
            "partial_char_rate": t["partial"] / n,
        }
    return report


def balance_warnings(report: dict[str, dict]) -> list[str]:
    """The silent inversion of a corpus's balance: one language gets under half the characters
    per token of another, so the same text costs it more than twice the tokens."""
    big = {s: r for s, r in report.items() if r["characters"] >= MIN_CHARS_FOR_WARNING}
    out = []
    for a, ra in big.items():
        for b, rb in big.items():
            if ra["chars_per_token"] < 0.5 * rb["chars_per_token"]:
                out.append(
                    f"WARNING: {LANGUAGE[a]} ({a}) gets {ra['chars_per_token']:.2f} characters/"
                    f"token, under half of {LANGUAGE[b]} ({b}) at {rb['chars_per_token']:.2f}: "
                    f"the same text costs {LANGUAGE[a]} over twice the tokens, which silently "
                    "inverts the corpus's language balance"
                )
    return out


def format_report(name: str, report: dict[str, dict]) -> str:
    cols = ("chars/tok", "bytes/tok", "words/tok", "tok/word", "fallback", "partial")
    lines = [
        f"fertility of {name}",
        f"{'script':<9}{'chars':>11}{'tokens':>10}" + "".join(f"{c:>11}" for c in cols),
    ]
    for s, r in report.items():
        lines.append(
            f"{s:<9}{r['characters']:>11,}{r['tokens']:>10,}{r['chars_per_token']:>11.3f}"
            f"{r['bytes_per_token']:>11.3f}{r['words_per_token']:>11.3f}"
            f"{r['tokens_per_word']:>11.3f}{r['byte_fallback_rate']:>10.3%}"
            f"{r['partial_char_rate']:>10.3%}"
        )
    return "\n".join(lines + balance_warnings(report))


# ---------------------------------------------------------------- loading any tokenizer


def load_any(path: str | Path, pattern: str | None = None) -> AnyTokenizer:
    """tokenizer.json (ours or any Hugging Face one), a Mistral tekken .json, a .tiktoken file,
    a SentencePiece model, or a WordPiece vocab.txt. A file its format's reader refuses
    (truncated, damaged) is a DoelError naming it."""
    p = Path(path)
    if not p.is_file():
        raise DoelError(f"tokenizer file not found: {p}")
    try:
        return _load_by_format(p, pattern)
    except DoelError:
        raise
    except Exception as e:  # noqa: BLE001 (json, base64, UTF-8, the Rust side's bare Exception)
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise DoelError(
            f"{p}: cannot be read as a {_format_name(p)} ({reason}); the file may be truncated "
            "or damaged: copy or write it again"
        ) from None


def _format_name(p: Path) -> str:
    if p.suffix == ".json":
        return "tokenizer.json or tekken file"
    if p.suffix == ".tiktoken":
        return ".tiktoken file"
    return "WordPiece vocab.txt" if p.name.endswith(".txt") else "SentencePiece model"


def _load_by_format(p: Path, pattern: str | None) -> AnyTokenizer:
    if p.suffix == ".json":
        head = json.loads(p.read_text(encoding="utf-8"))
        if "model" in head:
            return _load_hf(p, head)
        if "vocab" in head and "config" in head:
            return _load_tekken(p, head)
        raise DoelError(f"{p}: neither a tokenizer.json nor a tekken file")
    if p.suffix == ".tiktoken":
        return _load_tiktoken(p, pattern)
    if p.name.endswith(".txt"):
        return _load_wordpiece(p)
    return _load_sentencepiece(p)


def _invalid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def _bytes_only(raw: bytes) -> bool:
    """Holds fragments of characters and nothing else but whitespace."""
    return _invalid_utf8(raw) and not raw.decode("utf-8", errors="ignore").strip()


def _byte_flags(token_bytes: dict[int, bytes], n: int) -> tuple[np.ndarray, np.ndarray]:
    fallback, partial = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for i, raw in token_bytes.items():
        fallback[i], partial[i] = _bytes_only(raw), _invalid_utf8(raw)
    return fallback, partial


def _load_hf(p: Path, data: dict) -> AnyTokenizer:

    tok = Tokenizer.from_file(str(p))
    n = tok.get_vocab_size(with_added_tokens=True)
    vocab = tok.get_vocab(with_added_tokens=False)
    byte_level = "ByteLevel" in json.dumps(data.get("decoder")) + json.dumps(
        data.get("pre_tokenizer")
    )
    as_bytes = {
        i: bytes(BYTE_OF_CHAR[c] for c in t)
        for t, i in vocab.items()
        if byte_level and all(c in BYTE_OF_CHAR for c in t)
    }
    fallback, partial = _byte_flags(as_bytes, n)
    byte_piece = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
    unk = data["model"].get("unk_token")
    for token, i in vocab.items():
        if byte_piece.match(token) or token == unk:
            fallback[i] = partial[i] = True

    def encode_batch(texts):
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return AnyTokenizer(p.name, n, encode_batch, fallback, partial)


def _ranks_tokenizer(name, ranks: dict[bytes, int], pattern: str) -> AnyTokenizer:

    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    fallback, partial = _byte_flags({i: raw for raw, i in ranks.items()}, enc.n_vocab)
    return AnyTokenizer(name, enc.n_vocab, enc.encode_ordinary_batch, fallback, partial)


# Split patterns of OpenAI's published encodings (regexes, cited as facts of those formats).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


def _load_tiktoken(p: Path, pattern: str | None) -> AnyTokenizer:

    ranks = {}
    for line in p.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    pattern = pattern or (CL100K_PATTERN if "cl100k" in p.name else GPT2_PATTERN)
    return _ranks_tokenizer(p.name, ranks, pattern)


def _load_tekken(p: Path, data: dict) -> AnyTokenizer:

    n_special = data["config"].get("default_num_special_tokens", 0)
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in data["vocab"]}
    tok = _ranks_tokenizer(p.name, ranks, data["config"]["pattern"])
    # Tekken ids are ranks shifted past the special tokens; the shift changes no counts.
    tok.name = f"{p.name} (+{n_special} special)"
    return tok


def _load_sentencepiece(p: Path) -> AnyTokenizer:

    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(p))
    except Exception as e:
        raise DoelError(f"{p}: not a tokenizer format doel reads ({e})") from None
    n = sp.GetPieceSize()
    fallback = np.array([sp.IsByte(i) or sp.IsUnknown(i) for i in range(n)], dtype=bool)
    return AnyTokenizer(p.name, n, lambda texts: sp.Encode(texts), fallback)


def _load_wordpiece(p: Path) -> AnyTokenizer:

    vocab = {}
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        vocab.setdefault(line.strip(), i)
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    n = max(vocab.values()) + 1
    fallback = np.zeros(n, dtype=bool)
    if "[UNK]" in vocab:
        fallback[vocab["[UNK]"]] = True

    def encode_batch(texts):
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return AnyTokenizer(p.name, n, encode_batch, fallback)
