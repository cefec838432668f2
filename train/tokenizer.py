"""Train a byte-level BPE tokenizer that is fair to Bangla, and write it as tokenizer.json.

Why the pre-tokenizer matters: Bengali vowel signs, the virama and the nukta are combining
marks (\\p{M}), not letters. GPT-2-style split regexes use \\p{L} only, so they cut every
Bengali word at each sign and BPE can never merge across the cut (about 1.4 characters a token).
Here the letter class is [\\p{L}\\p{M} ZWNJ ZWJ], so a Bengali word stays one piece.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from train.common import DoelError, atomic_write_json
from train.config import resolved
from train.textio import Source, iter_source

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
N_RESERVED = 5
SPECIAL_TOKENS = [BOS, EOS, PAD] + [f"<|reserved_{i}|>" for i in range(N_RESERVED)]
N_BYTES = 256

_L = r"\p{L}\p{M}\x{200C}\x{200D}"  # letters, combining marks, ZWNJ, ZWJ
PATTERNS = {
    # Words keep their marks; an optional leading space or single punctuation character joins
    # the word; digits (ASCII and Bengali) go in groups of up to three; other symbols in runs.
    "doel": (
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{_L}\p{{N}}]?[{_L}]+|\p{{N}}{{1,3}}"
        rf"| ?[^\s{_L}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # The GPT-2 split, kept as the baseline that shows the trap (~1.4 chars/token on Bangla).
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 32768
    min_frequency: int = 2
    pre_tokenizer: str = "doel"
    max_token_length: int = 24  # in characters; long tokens are rare and waste vocabulary
    max_doc_chars: int = 10_000  # long documents are cut so one book cannot dominate the counts
    max_chars: int = 2_000_000_000  # training stops after this many characters
    text_field: str = "text"

    def __post_init__(self):
        floor = N_BYTES + len(SPECIAL_TOKENS)
        if self.vocab_size < floor:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the byte alphabet plus special "
                f"tokens ({floor}); choose at least {floor}, typically 32768"
            )
        if self.pre_tokenizer not in PATTERNS:
            raise ValueError(f"pre_tokenizer={self.pre_tokenizer!r}: choose one of {list(PATTERNS)}")
        for name in ("min_frequency", "max_token_length", "max_doc_chars", "max_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def build_tokenizer(pre_tokenizer: str = "doel"):
    """An untrained tokenizer with doel's normalizer, pre-tokenizer and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE())
    # NFC keeps the nukta (U+09BC), ZWJ and ZWNJ; note it turns ড় ঢ় য় into base + nukta.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERNS[pre_tokenizer]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def mix_documents(
    sources: list[Source],
    weights: dict[str, float] | None,
    text_field: str = "text",
    max_chars: int | None = None,
    keep=None,
) -> Iterator[tuple[str, str]]:
    """Yield (source name, document), interleaving sources so that their shares of characters
    follow `weights` (None: each source whole, in turn). With weights, the mix ends when the
    first source runs out, so no document is repeated and the shares hold."""
    if not weights:
        total = 0
        for src in sources:
            for doc in iter_source(src, text_field):
                if keep is None or keep(src.name, doc):
                    yield src.name, doc
                    total += len(doc)
                    if max_chars and total >= max_chars:
                        return
        return
    active = [s for s in sources if weights.get(s.name, 0) > 0]
    iters = {s.name: iter_source(s, text_field) for s in active}
    taken = dict.fromkeys(iters, 0)
    total = 0
    while True:
        # The source furthest behind its share goes next.
        name = min(iters, key=lambda n: taken[n] / weights[n])
        for doc in iters[name]:
            if keep is None or keep(name, doc):
                break
        else:
            return
        taken[name] += len(doc)
        total += len(doc)
        yield name, doc
        if max_chars and total >= max_chars:
            return


def train_tokenizer(
    sources: list[Source],
    cfg: TokenizerConfig,
    out_dir: str | Path,
    weights: dict[str, float] | None = None,
    progress: bool = True,
) -> Path:
    """Train on the sources and write tokenizer.json (+ the Hugging Face side files and the
    resolved config) to out_dir. Returns the tokenizer.json path."""
    from tokenizers import pre_tokenizers, processors, trainers

    tok = build_tokenizer(cfg.pre_tokenizer)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=cfg.max_token_length,
        show_progress=progress,
    )
    used: dict[str, dict[str, int]] = {}

    def texts() -> Iterator[str]:
        for name, doc in mix_documents(sources, weights, cfg.text_field, cfg.max_chars):
            doc = doc[: cfg.max_doc_chars]
            stats = used.setdefault(name, {"documents": 0, "characters": 0})
            stats["documents"] += 1
            stats["characters"] += len(doc)
            yield doc

    t0 = time.time()
    tok.train_from_iterator(texts(), trainer=trainer)
    if not used:
        names = ", ".join(s.name for s in sources)
        raise DoelError(f"no text found in {names}: the corpus is empty")
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tok.save(str(path))
    _write_hf_side_files(out)
    atomic_write_json(
        out / "doel_tokenizer.json",
        {
            "config": resolved(cfg),
            "weights": weights,
            "sources": used,
            "vocab_size": tok.get_vocab_size(),
            "seconds": round(time.time() - t0, 2),
        },
    )
    return path


def _write_hf_side_files(out: Path) -> None:
    """So that `AutoTokenizer.from_pretrained(out)` gives a PreTrainedTokenizerFast with the
    right special tokens."""
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    atomic_write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
            **specials,
        },
    )
    atomic_write_json(out / "special_tokens_map.json", specials)


def load_tokenizer(path: str | Path):
    """Load a tokenizer.json (or a folder holding one) for encoding documents, with a clear
    error when it is missing. Text that spells a special token ("<|eos|>") is encoded as plain
    text, so no document can inject a control token and decode(encode(s)) == NFC(s) always."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DoelError(
            f"tokenizer not found: {p}; make one with `doel-train tokenizer --data ... --out DIR`"
        )
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a plain Exception
        raise DoelError(f"{p}: not a valid tokenizer.json ({e})") from None
    tok.encode_special_tokens = True
    return tok


def special_ids(tok) -> dict[str, int | None]:
    return {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}


def tokenizer_summary(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {"model": data["model"]["type"], "vocab_size": len(data["model"]["vocab"])}
