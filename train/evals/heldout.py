"""Evaluate a checkpoint honestly: held-out bits per character per language, set against a
random-initialised twin of the same model and against general-purpose compressors, plus a few
greedy and sampled continuations to read.

Why bits per character and not perplexity: nats per token depend on the tokenizer (a tokenizer
with longer tokens gets a higher loss per token for the same text), so only a per-character
(or per-byte) figure compares models across tokenizers, and compares them with xz and bzip2.
Characters are counted after NFC, the normalisation the tokenizer applies, and the <|bos|> that
starts every document is context only: it is never scored and never counted.

The two reference points make a number mean something: the random twin (~ln V nats per token)
is what "learned nothing" looks like, and a model that does not beat `xz -9e` on the same text
has learned less than a dictionary coder does. `causal_leak` checks the one bug that makes
every figure here look too good: a model that can see the token it is asked to predict.
"""

from __future__ import annotations

import bz2
import contextlib
import lzma
import math
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from doel.train.common import DoelError
from doel.train.data.textio import iter_documents
from doel.train.data.tokenizer import load_tokenizer
from doel.train.dist import autocast, resolve_dtype
from doel.train.evals.cardeval import text_source
from doel.train.evals.generate import continuations
from doel.train.evals.modelcard import refresh_model_card
from doel.train.evals.published import BASELINES, comparison_table
from doel.train.evals.scoring import fmt_num, format_tasks, run_tasks
from doel.train.hf import load_model
from doel.train.model import IGNORE_INDEX, Llama

BENGALI = (0x0980, 0x09FF)  # the Bengali Unicode block, shared by Bangla and Assamese


def _device_of(model: torch.nn.Module, device) -> torch.device:
    return torch.device(device) if device is not None else next(model.parameters()).device


def windows(ids: Sequence[int], seq_len: int) -> list[list[int]]:
    """Cut one document's ids into windows of at most seq_len + 1 tokens that overlap by one.

    Window k holds ids[k·seq_len : (k+1)·seq_len + 1]: its inputs are all but the last token and
    its targets all but the first, so every token after the first is a target exactly once and
    the targets number len(ids) - 1. A chunk carries no context from the one before beyond its
    first token, so a document longer than one window scores a little worse than it would with
    the full context; scoring it in one window (seq_len >= len(ids) - 1) avoids that.
    """
    return [list(ids[s : s + seq_len + 1]) for s in range(0, len(ids) - 1, seq_len)]


def bar(progress: bool, **kw) -> tqdm:
    """A progress bar with an ETA on stderr, as prepare shows one: off with progress=False
    (--quiet) and whenever stderr is not a terminal (a log file, a pipe, the tests)."""
    return tqdm(disable=None if progress else True, dynamic_ncols=True, **kw)


@torch.no_grad()
def score_ids(
    model: Llama,
    docs: Sequence[Sequence[int]],
    seq_len: int,
    batch_size: int = 8,
    device=None,
    progress: tqdm | None = None,
) -> tuple[float, int]:
    """Total cross entropy (nats) and number of scored tokens over token-id documents; a
    `progress` bar advances by the windows of each batch."""
    if not 1 <= seq_len <= model.config.max_position_embeddings:
        raise ValueError(
            f"seq_len {seq_len} must lie in [1, {model.config.max_position_embeddings}] "
            "(the model's max_position_embeddings)"
        )
    device = _device_of(model, device)
    pad = model.config.pad_token_id
    # Longest first, so a batch holds windows of similar length and little padding.
    wins = sorted((w for d in docs for w in windows(d, seq_len)), key=len, reverse=True)
    was_training = model.training
    model.eval()
    nats, tokens = 0.0, 0
    try:
        for i in range(0, len(wins), batch_size):
            batch = wins[i : i + batch_size]
            width = len(batch[0]) - 1
            x = torch.full((len(batch), width), pad, dtype=torch.long)
            y = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
            for row, w in enumerate(batch):
                # Right padding is safe under causal attention: no real position sees it,
                # and its targets are ignored.
                x[row, : len(w) - 1] = torch.tensor(w[:-1])
                y[row, : len(w) - 1] = torch.tensor(w[1:])
            loss = model(x.to(device), y.to(device), reduction="sum")
            nats += float(loss)
            tokens += sum(len(w) - 1 for w in batch)
            if progress is not None:
                progress.update(len(batch))
    finally:
        model.train(was_training)
    return nats, tokens


def encode_texts(tokenizer, texts: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """The texts after NFC, empty ones dropped, and their token ids (<|bos|> first)."""
    texts = [unicodedata.normalize("NFC", t) for t in texts]
    texts = [t for t in texts if t]
    return texts, [e.ids for e in tokenizer.encode_batch(texts)] if texts else []


def bits_per_char(
    model: Llama, tokenizer, texts: Sequence[str], seq_len: int, batch_size: int = 8, device=None
) -> dict:
    """Held-out loss of `model` on documents: nats per token, bits per NFC character and per
    UTF-8 byte (the <|bos|> excluded from both), with the counts behind them. `device` defaults
    to the model's own."""
    return doc_figures(model, *encode_texts(tokenizer, texts), seq_len, batch_size, device)


def doc_figures(
    model: Llama,
    texts: list[str],
    docs: list[list[int]],
    seq_len: int,
    batch_size: int = 8,
    device=None,
    progress: tqdm | None = None,
) -> dict:
    """`bits_per_char` of texts already through `encode_texts`."""
    nats, tokens = score_ids(model, docs, seq_len, batch_size, device, progress)
    chars = sum(len(t) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    bits = nats / math.log(2)
    return {
        "nats_per_token": nats / tokens if tokens else float("nan"),
        "bits_per_char": bits / chars if chars else float("nan"),
        "bits_per_byte": bits / nbytes if nbytes else float("nan"),
        "tokens": tokens,
        "chars": chars,
        "documents": len(texts),
    }


def read_texts(paths: Sequence[str], max_chars: int | None = None) -> list[str]:
    """Documents of the files (any format textio reads), stopping once max_chars are read."""

    texts, total = [], 0
    for path in paths:
        for doc in iter_documents(str(path)):
            if max_chars is not None and total >= max_chars:
                return texts
            texts.append(doc)
            total += len(doc)
    return texts


def bengali_share(text: str) -> float:
    """Share of Bengali-script characters among the letters and marks of text. Digits, spaces
    and punctuation are left out: both languages use them, so they would only dilute."""
    letters = [c for c in text if unicodedata.category(c)[0] in "LM"]
    if not letters:
        return 0.0
    return sum(BENGALI[0] <= ord(c) <= BENGALI[1] for c in letters) / len(letters)


def guess_language(path: str, sample_chars: int = 100_000) -> str:
    """'bn' when most letters in the first sample_chars of the file are Bengali, else 'en'."""
    return "bn" if bengali_share("\n".join(read_texts([path], sample_chars))) >= 0.5 else "en"


def group_by_language(paths: Sequence[str]) -> dict[str, list[str]]:
    """Files grouped by their guessed language, in the order given."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        groups.setdefault(guess_language(path), []).append(str(path))
    return groups


def per_language(
    model: Llama,
    tokenizer,
    paths_by_language: dict[str, list[str]],
    seq_len: int,
    batch_size: int = 8,
    device=None,
    max_chars: int | None = None,
) -> dict[str, dict]:
    """`bits_per_char` for each language's files (at most max_chars characters a language)."""
    return {
        lang: bits_per_char(
            model, tokenizer, read_texts(paths, max_chars), seq_len, batch_size, device
        )
        for lang, paths in paths_by_language.items()
    }


def random_twin(model: Llama, seed: int = 0) -> Llama:
    """A freshly initialised model with the same config, dtype and device. The global RNG is
    left as it was, so asking for a twin does not change what the caller samples next."""
    p = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = Llama(model.config)  # built on CPU, so the seed fixes it on any device
    return twin.to(device=p.device, dtype=p.dtype).eval()


def compressor_bits_per_char(texts: Sequence[str]) -> dict[str, float]:
    """Bits per character that xz -9e and bzip2 -9 need for the NFC texts joined by newlines.
    The denominator is the documents' characters without the joining newlines, as in
    `bits_per_char`; the compressors' headers (tens of bytes) are included, which matters
    only on tiny samples."""
    texts = [unicodedata.normalize("NFC", t) for t in texts]
    chars = sum(len(t) for t in texts)
    data = "\n".join(texts).encode("utf-8")
    sizes = {
        "xz -9e": len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)),
        "bzip2 -9": len(bz2.compress(data, compresslevel=9)),
    }
    return {name: 8 * n / chars if chars else float("nan") for name, n in sizes.items()}


def token_logprobs(model: Llama, idx: torch.Tensor) -> torch.Tensor:
    """Log-softmax of the logits, (B, T, V) float32: position t predicts token t + 1."""
    return F.log_softmax(model(idx).float(), dim=-1)


@torch.no_grad()
def causal_leak(model, idx: torch.Tensor, positions: Sequence[int] | None = None) -> float:
    """The largest change in any predicted log-probability at positions <= t when only the
    token at t + 1 is replaced, over t in `positions` (default: every t). 0 (to float
    rounding) for a causal model.

    Why whole distributions and not the loss against the next token: the loss at position t has
    token t + 1 as its target, so it changes legitimately when that token does; the predicted
    distribution at t must not, and comparing all of it checks every possible target at once.
    """
    was_training = model.training
    model.eval()
    try:
        base = token_logprobs(model, idx)
        vocab, worst = base.size(-1), 0.0
        for t in positions if positions is not None else range(idx.size(1) - 1):
            bent = idx.clone()
            bent[:, t + 1] = (bent[:, t + 1] + 1) % vocab  # a different, valid token
            diff = (token_logprobs(model, bent) - base)[:, : t + 1].abs().max()
            worst = max(worst, float(diff))
    finally:
        model.train(was_training)
    return worst


def evaluate_checkpoint(
    folder: str | Path,
    text_paths: Sequence[str] | dict[str, list[str]],
    seq_len: int | None = None,
    max_chars: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    prompts: Sequence[str] | None = None,
    max_new_tokens: int = 40,
    seed: int = 0,
    tasks: dict[str, str] | None = None,
    limit: int | None = None,
    card: bool = True,
    progress: bool = True,
    repo_id: str | None = None,
    dtype: str = "auto",
) -> dict:
    """Everything above for a model folder in Hugging Face layout (with its tokenizer.json).
    text_paths is a list of files (grouped by guessed language) or {language: files}; at most
    max_chars characters are read per language; seq_len defaults to the model's context.
    tasks: {name: file or folder} of zero-shot tasks (`train/evals/tasks.py`), the first `limit`
    items of each. With `card`, a folder that has doel's model card gets it written again with
    these results (its path is the result's "model_card"; a folder without one is left alone),
    and with `repo_id` (its Hugging Face repository) in its usage example from then on.
    `progress`: a bar with an ETA for each part (held-out text, tasks, sample texts) on a
    terminal's stderr. `dtype`: the autocast of every pass (`eval_autocast`)."""

    model = load_model(folder, device=device).eval()
    tokenizer = load_tokenizer(folder)
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise DoelError(
            f"{folder}: tokenizer.json has {tokenizer.get_vocab_size()} tokens but the model "
            f"only {model.config.vocab_size}; they do not belong together"
        )
    seq_len = seq_len or model.config.max_position_embeddings
    groups = text_paths if isinstance(text_paths, dict) else group_by_language(text_paths)
    for paths in groups.values():
        check_not_empty(paths)
    twin = random_twin(model, seed)
    raw = {lang: read_texts(paths, max_chars) for lang, paths in groups.items()}
    encoded = {lang: encode_texts(tokenizer, texts) for lang, texts in raw.items()}
    n = sum(len(windows(d, seq_len)) for _, docs in encoded.values() for d in docs)
    with eval_autocast(model, dtype):  # bf16 on CUDA: fp32 with GQA has no fused SDPA
        held = bar(progress, total=2 * n, desc="held-out text (model, twin)", unit="window")
        languages = {}
        try:
            for lang, paths in groups.items():
                texts, docs = encoded[lang]
                languages[lang] = {
                    "files": [str(p) for p in paths],
                    "texts": [text_source(p) for p in paths],  # what the card names each row by
                    "model": doc_figures(model, texts, docs, seq_len, batch_size, progress=held),
                    "twin": doc_figures(twin, texts, docs, seq_len, batch_size, progress=held),
                    "compressors": compressor_bits_per_char(raw[lang]),
                }
        finally:
            held.close()
        result = {
            "checkpoint": str(folder),
            "seq_len": seq_len,
            "vocab_size": model.config.vocab_size,
            "parameters": model.num_parameters(),
            "languages": languages,
            "tasks": run_tasks(model, tokenizer, tasks or {}, limit, batch_size, progress),
            "continuations": continuations(
                model, tokenizer, prompts, max_new_tokens, seed=seed, progress=progress
            ),
        }
    path = refresh_model_card(folder, result, repo_id) if card else None
    return result | {"model_card": str(path) if path else None}


def eval_autocast(model, dtype: str = "auto"):
    """The autocast an evaluation runs under: `dtype` ("auto", "bfloat16", "float32") as a
    run resolves it on the model's device, except that "auto" keeps a CPU in float32 (the
    figures of a CPU evaluation stay those of the weights). On CUDA, "auto" is bfloat16: in
    float32, attention with grouped KV heads has no fused SDPA kernel and silently takes the
    math one (a (T, T) matrix a head)."""
    device = next(model.parameters()).device
    if dtype == "auto" and device.type != "cuda":
        return contextlib.nullcontext()
    return autocast(device, resolve_dtype(dtype, device))


def check_not_empty(paths: Sequence[str]) -> None:
    """A text with no characters to score is an error, not a row of zeros and n/a: the figure
    would replace a real one on the model card (issue 38)."""
    for path in paths:
        if not any(doc.strip() for doc in read_texts([path], max_chars=1)):
            raise DoelError(
                f"{path}: no text to evaluate on (an empty file, or no documents in it); "
                "pass a held-out text with some characters"
            )


def twin_warnings(result: dict) -> list[str]:
    """One line for each text the trained model does not beat its random twin on (bits per
    character no lower): its figures say it learnt nothing that carries over to that text."""
    lines = []
    for lang, r in result["languages"].items():
        model, twin = r["model"]["bits_per_char"], r["twin"]["bits_per_char"]
        if not model < twin:  # nan included: no figure is not a win
            names = ", ".join(t["name"] for t in r.get("texts") or []) or lang
            lines.append(
                f"WARNING: on {lang} ({names}) the trained model does not beat its random twin "
                f"({fmt_num(model, '.3f')} against {fmt_num(twin, '.3f')} bits/char): it has "
                "not learnt anything that carries over to this text"
            )
    return lines


def format_eval(result: dict) -> str:
    """A Markdown table of the figures per language, then the continuations."""
    lines = [
        f"{result['checkpoint']}: {result['parameters']:,} parameters, vocabulary "
        f"{result['vocab_size']:,}, windows of {result['seq_len']} tokens "
        f"(random twin: ln V = {math.log(result['vocab_size']):.3f} nats/token)",
        "",
        "| language | documents | characters | nats/token | bits/char | twin bits/char "
        "| xz -9e bits/char | bzip2 -9 bits/char |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lang, r in result["languages"].items():
        m, c = r["model"], r["compressors"]
        figures = (m["nats_per_token"], m["bits_per_char"], r["twin"]["bits_per_char"])
        figures += (c["xz -9e"], c["bzip2 -9"])
        lines.append(
            f"| {lang} | {m['documents']:,} | {m['chars']:,} | "
            + " | ".join(fmt_num(x, ".3f") for x in figures)
            + " |"
        )
    if warnings := twin_warnings(result):
        lines += ["", *warnings]
    if result.get("tasks"):
        lines += [
            "",
            "Zero-shot tasks (± bootstrap standard error):",
            "",
            format_tasks(result["tasks"]),
        ]
    if set(result.get("tasks") or ()) & set(BASELINES):  # a TituLLM set: beside its baselines
        lines += ["", "Beside published small models (± standard error):", ""]
        lines.append(comparison_table(result["tasks"]))
    for sample in result.get("continuations", []):
        lines += [
            "",
            f"prompt:  {sample['prompt']}",
            f"greedy:  {sample['greedy']!r}",
            f"sampled: {sample['sampled']!r}",
        ]
    if result.get("model_card"):
        lines += ["", f"model card updated with these figures: {result['model_card']}"]
    return "\n".join(lines)
