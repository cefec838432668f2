"""Train a BPE tokenizer that is fair to Bangla, and write it as tokenizer.json.

Why the pre-tokenizer matters: Bengali vowel signs, the virama and the nukta are combining
marks (\\p{M}), not letters. GPT-2-style split regexes use \\p{L} only, so they cut every
Bengali word at each sign and BPE can never merge across the cut (about 1.4 characters a token).
Here the letter class is [\\p{L}\\p{M} ZWNJ ZWJ], so a Bengali word stays one piece, and a
word keeps one trailing punctuation mark (danda, comma...) so "গেল।" can be a single token.

Why BPE over characters with byte fallback (as Llama and Mistral do) rather than over bytes:
every Bengali character is three UTF-8 bytes, and byte-level BPE spends merges on the bytes
inside characters and on tokens that end in the middle of one. Over characters, every string
still encodes (an unseen character becomes its <0xNN> byte tokens) and the vocabulary goes to
real units: +0.2 characters/token on Bangla in benchmarks/results/tokenizer.md.
"""

from __future__ import annotations

import json
import time
import unicodedata
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from doel.train.common import DoelError, atomic_write_bytes, atomic_write_json
from doel.train.config import resolved
from doel.train.data.bytelevel import QWEN35, respell_byte_level
from doel.train.data.spm import nfc, smallest, train_spm
from doel.train.data.textio import Source, iter_source

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# Chat turn markers. They hold ids 3-6, the ones tokenizers made before chat named
# <|reserved_0|> to <|reserved_3|>, so every doel vocabulary has them at the same ids.
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, END)
N_RESERVED = 5
SPECIAL_TOKENS = [BOS, EOS, PAD, *CHAT_TOKENS, f"<|reserved_{N_RESERVED - 1}|>"]
# The one chat template (a Jinja string, as transformers' apply_chat_template and llama.cpp
# read it): <|bos|>, then <|role|>content<|end|> a message, then <|assistant|> when a reply is
# wanted. The model stops a reply by writing <|end|>. Tools (transformers' `tools=`, OpenAI's
# function definitions) go in the system turn after its content: TOOLS_HEADER, then each
# function's definition as one JSON line. An assistant's calls follow its content, each
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>; a tool's result is a user turn
# <tool_response>result</tool_response>. All of it is text: the vocabulary is every doel
# vocabulary's (no new special token), and train/data/chat.py renders the same text in ids.
# Every message's content is printed exactly once, in order (serve/core/template.py relies on it).
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
TOOLS_HEADER = (
    'Functions you may call, as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:\n'
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|system|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + repr(TOOLS_HEADER) + " }}"
    "{% for tool in tools %}"
    # Each function as name, description and parameters ("" and {} where absent, nothing
    # else): what llama-server makes of an OpenAI tool before its template runs, so a request
    # renders one prompt in every engine.
    "{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ {'name': f['name'], 'description': f['description'] if f['description'] is defined "
    "else '', 'parameters': f['parameters'] if f['parameters'] is defined else {}} | tojson }}"
    "{{ '\\n' }}"
    "{% endfor %}{{ '<|end|>' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>"
    + TOOL_RESPONSE
    + "' + message['content'] + '"
    + TOOL_RESPONSE_END
    + "<|end|>' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>' }}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '" + TOOL_CALL + "' }}{% if f['arguments'] is string %}"
    "{{ '{\"name\": ' + f['name'] | tojson + ', \"arguments\": ' + f['arguments'] + '}' }}"
    "{% else %}{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}{% endif %}"
    "{{ '" + TOOL_CALL_END + "' }}{% endfor %}{{ '<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
N_BYTES = 256

# Letters, combining marks, ZWNJ and ZWJ. The two joiners are the characters themselves, not
# \x{200C} escapes: Oniguruma (tokenizers) reads either, other regex engines that load
# tokenizer.json (onnxruntime-genai's) refuse the escape. Both spellings give the same ids.
_L = r"\p{L}\p{M}" + "\u200c\u200d"
PATTERNS = {
    # Words keep their marks and one trailing punctuation mark; before a word may stand one
    # space or punctuation character, or a space and one punctuation character (' "word',
    # ' ‘কথা'); digits (ASCII and Bengali) go in groups of up to three; other symbols in runs.
    "doel": (
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:[^\r\n{_L}\p{{N}}]| [^\s{_L}\p{{N}}])?[{_L}]+"
        rf"[,.।;:!?]?|\p{{N}}{{1,3}}| ?[^\s{_L}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # The plain fix: GPT-4's split with combining marks in the letter class (an ablation).
    "marks": (
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{_L}\p{{N}}]?[{_L}]+|\p{{N}}{{1,3}}"
        rf"| ?[^\s{_L}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # The GPT-2 split, kept as the baseline that shows the trap (~1.4 chars/token on Bangla).
    "gpt2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    # llama.cpp's qwen35 pre-type, verbatim: the "gguf" style's split (train/data/bytelevel.py).
    "qwen35": QWEN35,
}
# style -> (split pattern, byte-level BPE?)
STYLES = {
    "doel": ("doel", False),
    "doel-bytelevel": ("doel", True),
    "marks-bytelevel": ("marks", True),
    "gpt2": ("gpt2", True),
    # Trained over characters, written as byte-level BPE that llama.cpp runs id for id.
    "gguf": ("qwen35", False),
    # SentencePiece BPE, no split at all: llama.cpp's "llama" vocabulary (train/data/spm.py).
    "spm": (None, False),
}
# Always whole tokens, whatever the corpus: the Bengali block, printable ASCII, a few marks.
ALPHABET = [chr(c) for c in range(0x0980, 0x0A00) if unicodedata.category(chr(c)) != "Cn"]
ALPHABET += [chr(c) for c in range(32, 127)] + list("\n\t।॥\u200c\u200d‘’“”—–…")


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 32768
    min_frequency: int = 2
    # spm runs unchanged in llama.cpp at no cost to Bangla or English: benchmarks/results/spm.md.
    # doel: doel's own split (a GGUF cannot carry it); gguf (llama.cpp); ablations:
    # doel-bytelevel, marks-bytelevel, gpt2
    style: str = "spm"
    max_token_length: int = 24  # in characters; long tokens are rare and waste vocabulary
    limit_alphabet: int = 1000  # rarer characters are spelled with byte tokens
    max_doc_chars: int = 10_000  # long documents are cut so one book cannot dominate the counts
    max_chars: int = 2_000_000_000  # training stops after this many characters
    text_field: str = "text"
    # spm: train on the text NFC, as prepare gives it to the model (llama.cpp itself normalizes
    # nothing, so the tokenizer does not either). The other styles ignore it.
    nfc_text: bool = True

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"style={self.style!r}: choose one of {list(STYLES)}")
        floor = smallest_vocab(self.style, self.limit_alphabet)
        if self.vocab_size < floor:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the smallest possible for style "
                f"{self.style!r}: {floor} ({_floor_parts(self.style, floor)}); choose at least "
                f"{floor}, typically 32768"
            )
        for name in (
            "min_frequency",
            "max_token_length",
            "limit_alphabet",
            "max_doc_chars",
            "max_chars",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def smallest_vocab(style: str, limit_alphabet: int = 1000) -> int:
    """The vocabulary before any merge, on any corpus: the special tokens, the 256 bytes (byte
    tokens, or the byte-level alphabet), and in the character styles every ALPHABET character
    (the trainer keeps them whole); a corpus's other characters can add more, up to
    limit_alphabet characters in all."""
    if style == "spm":
        return smallest(ALPHABET, len(SPECIAL_TOKENS), N_BYTES)
    chars = 0 if STYLES[style][1] else min(len(set(ALPHABET)), limit_alphabet)
    return len(SPECIAL_TOKENS) + N_BYTES + chars


def _floor_parts(style: str, floor: int) -> str:
    chars = floor - len(SPECIAL_TOKENS) - N_BYTES
    kept = f", {chars} characters kept whole" if chars else ""
    return f"{len(SPECIAL_TOKENS)} special, {N_BYTES} byte tokens{kept}"


def pad_vocabulary(data: dict, size: int) -> list[str]:
    """Fill a tokenizer.json (as a dict) up to `size` ids with unused special tokens
    <|reserved_N|>, numbered on from the N_RESERVED reserved at the start. Like those, each is in
    the model's vocabulary and an added special token, so the file keeps its ids in every loader
    (tokenizers, transformers, llama.cpp). No merge builds them and doel encodes text with
    special tokens matched as text, so encoding is unchanged. Returns the tokens added."""
    vocab = data["model"]["vocab"]
    next_id = 1 + max([*vocab.values(), *(a["id"] for a in data["added_tokens"])])
    added, k = [], N_RESERVED
    while next_id < size:
        token = f"<|reserved_{k}|>"
        k += 1
        if token in vocab:
            continue
        vocab[token] = next_id
        data["added_tokens"].append(
            {
                "id": next_id,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        added.append(token)
        next_id += 1
    return added


def build_tokenizer(style: str = "doel"):
    """An untrained tokenizer with doel's normalizer, pre-tokenizer, model and decoder."""

    pattern, byte_level = STYLES[style]
    split = pre_tokenizers.Split(Regex(PATTERNS[pattern]), behavior="isolated")
    # NFC keeps the nukta (U+09BC), ZWJ and ZWNJ; note it turns ড় ঢ় য় into base + nukta.
    if byte_level:
        tok = Tokenizer(models.BPE())
        bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, bl])
        tok.decoder = decoders.ByteLevel()
    else:
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = split
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    if style != "gguf":  # llama.cpp normalizes nothing: NFC would make the two disagree
        tok.normalizer = normalizers.NFC()
    return tok


def mix_documents(
    sources: list[Source],
    weights: dict[str, float] | None,
    text_field: str = "text",
    max_chars: int | None = None,
    keep=None,
    position: dict[str, list[int]] | None = None,
) -> Iterator[tuple[str, str]]:
    """Yield (source name, document), interleaving sources so that their shares of characters
    follow `weights` (None: each source whole, in turn). With weights, the mix ends when the
    first source runs out, so no document is repeated and the shares hold.

    `keep(name, doc)`, when given, is asked once for every document read, in order; a refused
    one is skipped. `position` maps each source to [documents read, characters yielded] and is
    kept up to date: a mix started from a saved copy skips what was read (without asking
    `keep`) and continues exactly as the uninterrupted mix would (prepare's resume)."""
    pos = {} if position is None else position
    for s in sources:
        pos.setdefault(s.name, [0, 0])
    if not weights:
        total = sum(p[1] for p in pos.values())
        for src in sources:
            for doc in _read_from(src, text_field, pos[src.name]):
                if keep is None or keep(src.name, doc):
                    pos[src.name][1] += len(doc)  # before the yield: a saved copy counts it
                    total += len(doc)
                    yield src.name, doc
                    if max_chars and total >= max_chars:
                        return
        return
    active = [s for s in sources if weights.get(s.name, 0) > 0]
    iters = {s.name: _read_from(s, text_field, pos[s.name]) for s in active}
    total = sum(p[1] for p in pos.values())
    while True:
        # The source furthest behind its share goes next.
        name = min(iters, key=lambda n: pos[n][1] / weights[n])
        for doc in iters[name]:
            if keep is None or keep(name, doc):
                break
        else:
            return
        pos[name][1] += len(doc)
        total += len(doc)
        yield name, doc
        if max_chars and total >= max_chars:
            return


def _read_from(src: Source, text_field: str, pos: list[int]) -> Iterator[str]:
    """The source's documents after the first pos[0], counting each one read into pos[0]."""
    docs = iter_source(src, text_field)
    deque(islice(docs, pos[0]), maxlen=0)  # read before: parsed, not normalized or kept
    for doc in docs:
        pos[0] += 1
        yield doc


def train_tokenizer(
    sources: list[Source],
    cfg: TokenizerConfig,
    out_dir: str | Path,
    weights: dict[str, float] | None = None,
    progress: bool = True,
    log=print,
) -> Path:
    """Train on the sources and write tokenizer.json (+ the Hugging Face side files and the
    resolved config) to out_dir. Returns the tokenizer.json path. The vocabulary has exactly
    cfg.vocab_size tokens, the size the model's embedding is given: when the corpus runs out of
    merges first, unused reserved tokens fill it (logged in one line); a size below what the
    corpus's characters need is refused."""

    used: dict[str, dict[str, int]] = {}

    def texts() -> Iterator[str]:
        for name, doc in mix_documents(sources, weights, cfg.text_field, cfg.max_chars):
            doc = doc[: cfg.max_doc_chars]
            stats = used.setdefault(name, {"documents": 0, "characters": 0})
            stats["documents"] += 1
            stats["characters"] += len(doc)
            yield doc

    t0 = time.time()
    if cfg.style == "spm":  # SentencePiece reads the whole corpus first (as it trains)
        docs = list(nfc(texts()) if cfg.nfc_text else texts())
        specials = (SPECIAL_TOKENS, BYTE_TOKENS, ALPHABET)
        size = cfg.vocab_size
        data = docs and train_spm(docs, size, *specials, cfg.max_token_length, cfg.max_doc_chars)
        if data:
            data["post_processor"] = _bos_first(data)
    else:
        data = _train_bpe(texts(), cfg, progress)
    if not used:
        names = ", ".join(s.name for s in sources)
        raise DoelError(f"no text found in {names}: the corpus is empty")
    learned = len(data["model"]["vocab"])
    if learned > cfg.vocab_size:  # the corpus's characters alone are more than asked
        raise DoelError(
            f"vocab_size={cfg.vocab_size} is smaller than the smallest possible on this corpus: "
            f"{learned} ({_floor_parts(cfg.style, learned)}); choose at least {learned}, or "
            "lower limit_alphabet to spell rare characters with byte tokens"
        )
    padding = pad_vocabulary(data, cfg.vocab_size)
    if padding:
        log(
            f"the corpus ran out of merges at {learned:,} tokens (min_frequency="
            f"{cfg.min_frequency}): {len(padding):,} unused reserved tokens ({padding[0]} to "
            f"{padding[-1]}) fill the vocabulary to the {cfg.vocab_size:,} asked"
        )
    text = json.dumps(data, ensure_ascii=False, indent=1)
    written = Tokenizer.from_str(text)  # refuse to write a file that does not load
    if written.get_vocab_size() != cfg.vocab_size:
        raise AssertionError(f"{written.get_vocab_size()} tokens written, {cfg.vocab_size} asked")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    atomic_write_bytes(path, text.encode("utf-8"))
    write_hf_side_files(out)
    atomic_write_json(
        out / "doel_tokenizer.json",
        {
            "config": resolved(cfg),
            "weights": weights,
            "sources": used,
            "vocab_size": cfg.vocab_size,
            "learned_tokens": learned,  # the rest are unused reserved tokens
            "seconds": round(time.time() - t0, 2),
        },
    )
    return path


def _train_bpe(texts: Iterator[str], cfg: TokenizerConfig, progress: bool) -> dict:
    """The tokenizers library's BPE trainer on `texts`: tokenizer.json as a dict."""
    tok = build_tokenizer(cfg.style)
    byte_level = STYLES[cfg.style][1]
    if byte_level:
        alphabet = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
    else:
        alphabet = {"initial_alphabet": ALPHABET, "limit_alphabet": cfg.limit_alphabet}
    trainer = trainers.BpeTrainer(
        # The gguf style's one-byte characters share their byte tokens' ids, freeing up to 128:
        # it learns that many merges more, and re-spelling keeps cfg.vocab_size of them.
        vocab_size=cfg.vocab_size + (128 if cfg.style == "gguf" else 0),
        min_frequency=cfg.min_frequency,
        # Byte fallback needs the 256 <0xNN> tokens in the vocabulary, right after the specials.
        special_tokens=SPECIAL_TOKENS + ([] if byte_level else BYTE_TOKENS),
        max_token_length=cfg.max_token_length,
        show_progress=progress,
        **alphabet,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    data = json.loads(tok.to_str())
    data["post_processor"] = _bos_first(data)
    # The byte tokens were passed as special only to reserve their ids; as added tokens they
    # would be matched in text ("<0x41>") and skipped by decode, so they stay model-only.
    data["added_tokens"] = [a for a in data["added_tokens"] if a["content"] not in BYTE_TOKENS]
    if cfg.style == "gguf":
        respell_byte_level(data, cfg.vocab_size)
    return data


def _bos_first(data: dict) -> dict:
    """The post-processor that puts <|bos|> in front of every text (tokenizer.json's form)."""
    bos = data["model"]["vocab"][BOS]
    post = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return json.loads(post.__getstate__())


def write_hf_side_files(out: Path) -> None:
    """So that `AutoTokenizer.from_pretrained(out)` gives a PreTrainedTokenizerFast with the
    right special tokens, doel's ids (<|bos|> once) and only the inputs a Llama takes. Also
    written into every checkpoint (train/hf.py), whatever the tokenizer folder held."""
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    vocab = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    # Only a vocabulary that names the turn markers gets the template (an older one has them
    # as <|reserved_N|> at the same ids: its template would name tokens it lacks).
    chat = set(CHAT_TOKENS) <= {t["content"] for t in vocab}
    atomic_write_json(
        out / "tokenizer_config.json",
        {
            # The plain fast class: tokenizer.json's post-processor adds <|bos|> once. A Llama
            # class would add its own BOS handling on top (and invent <s> when it is missing).
            "tokenizer_class": "PreTrainedTokenizerFast",
            # Without it transformers 4.x returns token_type_ids, which generate() refuses.
            "model_input_names": ["input_ids", "attention_mask"],
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
            **specials,
            **({"chat_template": CHAT_TEMPLATE} if chat else {}),
        },
    )
    atomic_write_json(out / "special_tokens_map.json", specials)


def tokenizer_file(path: str | Path) -> Path:
    """A tokenizer.json, or the one inside a folder."""
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def load_tokenizer(path: str | Path):
    """Load a tokenizer.json (or a folder holding one) for encoding documents, with a clear
    error when it is missing. Text that spells a special token ("<|eos|>") is encoded as plain
    text, so no document can inject a control token and decode(encode(s)) == NFC(s) always."""

    p = tokenizer_file(path)
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
