"""`doel-train adapt`: an imported model folder and Bangla and English text -> a chat model with a
tokenizer fair to Bangla, in one command that resumes where it stopped.

    RUN/adapted/    the base with the new tokenizer and its new rows (init.py); made once
    RUN/shards/     the text in the new vocabulary (prepare: balance, overlap, resume)
    RUN/pretrain/   continued pretraining (pretrain.py: fit's run folder, checks, resume)
    RUN/base/       its final model with the base's tokenizer files (chat template, stops)
    RUN/chat/       chat fine-tuning in the base's own template (chat.py), if --chat is given
    RUN/final       the model to export: chat/final, or base/ without --chat

Each stage is skipped when its output is whole, so a rerun continues the stage that was cut
off (the pretraining and the chat run from their last checkpoints). The default tokenizer
choice comes from benchmarks/results/adapt_tokenizers.md (docs/adapt.md says why).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from doel.train.adapt.chat import chat_finetune
from doel.train.adapt.init import RECORD, keep_tokenizer_files, write_adapted
from doel.train.adapt.pretrain import continue_pretraining, make_shards
from doel.train.adapt.vocab import SPLITS, extend
from doel.train.common import DoelError, atomic_write_json
from doel.train.config import PACKAGE, shipped_dirs
from doel.train.data.conversations import SFTConfig
from doel.train.data.prepare import PrepareConfig, parse_weights
from doel.train.data.textio import iter_documents, resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
from doel.train.hf import read_config
from doel.train.settings import TrainConfig

TOKENIZERS = ("extend", "spm", "keep")
# recipes/ in a checkout; the wheel ships it as doel/pipeline/recipes
PRESET_DIRS = (*shipped_dirs("recipes"), *shipped_dirs("recipes", PACKAGE.parent / "pipeline"))


def _pretrain_default() -> TrainConfig:
    return TrainConfig(seq_len=1024, batch_size=8, steps=1000, lr=3e-4, warmup_steps=50)


def _chat_default() -> SFTConfig:
    return SFTConfig(seq_len=512, batch_size=4, steps=200, lr=5e-5, warmup_steps=10)


@dataclass(frozen=True)
class AdaptConfig:
    """`doel-train adapt`'s settings. TOML: the keys below, [pretrain] (TrainConfig's), [chat]
    (SFTConfig's; the [model] of both is the base's) and [prepare] (PrepareConfig's). A table
    given in TOML starts from those classes' defaults, not from the defaults here."""

    tokenizer: str = "extend"  # extend the base's | spm: replace with doel's | keep the base's
    # extend: "qwen35" keeps a Bangla word whole in a split llama.cpp runs (docs/adapt.md);
    # "marks" widens the base's own split; "base" keeps it (cuts at every vowel sign)
    split: str = "qwen35"
    new_tokens: int = 8192  # extend: the most tokens added
    spm_vocab_size: int = 32768  # spm: the replacing vocabulary's size
    tokenizer_chars: int = 20_000_000  # characters of the text the new tokens are learned on
    pretrain: TrainConfig = field(default_factory=_pretrain_default)
    chat: SFTConfig = field(default_factory=_chat_default)
    prepare: PrepareConfig = field(default_factory=lambda: PrepareConfig(val_fraction=0.01))

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        for name in ("new_tokens", "spm_vocab_size", "tokenizer_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")


def presets() -> list[str]:
    """The shipped adapt presets: recipes/NAME/adapt.toml."""
    return sorted(
        {p.parent.name for d in PRESET_DIRS if d.is_dir() for p in d.glob("*/adapt.toml")}
    )


def resolve_preset(name: str | None) -> Path | None:
    """A TOML path, or a preset name (recipes/NAME/adapt.toml); None: the defaults."""
    if name is None or Path(name).is_file():
        return Path(name) if name else None
    for folder in PRESET_DIRS:
        if (folder / name / "adapt.toml").is_file():
            return folder / name / "adapt.toml"
    raise DoelError(f"config {name!r} is neither a file nor an adapt preset; presets: {presets()}")


def adapted_model(base: Path, data: list[str], run: Path, cfg: AdaptConfig, weights=(), log=print):
    """RUN/adapted (the base itself for tokenizer=keep) and how many of its first rows are the
    base's (none for a replaced vocabulary)."""
    n_base = read_config(base).vocab_size
    if cfg.tokenizer == "keep":
        return base, n_base
    out = run / "adapted"
    want = {"base": str(base), "tokenizer": cfg.tokenizer, "split": cfg.split}
    want |= {"new_tokens": cfg.new_tokens, "spm_vocab_size": cfg.spm_vocab_size}
    if (out / RECORD).is_file():
        have = json.loads((out / RECORD).read_text(encoding="utf-8"))
        if {k: have.get(k) for k in want} == want:
            return out, n_base if cfg.tokenizer == "extend" else 0
        raise DoelError(f"{out} was made with other settings ({have}); use another --out")
    adapted = _tokenizer(base, data, run, cfg, weights, log)
    counts = write_adapted(base, adapted, out, cfg.tokenizer == "extend", want)
    n_base = n_base if cfg.tokenizer == "extend" else 0
    rows = f"{counts['new']:,} new" if cfg.tokenizer == "extend" else "every one replaced"
    log(
        f"adapted vocabulary: {counts['vocab']:,} tokens ({rows}, their rows the mean of the "
        f"base's rows of their text) in {out}"
    )
    return out, n_base


def bangla_texts(data: list[str], chars: int) -> list[str]:
    """The documents of `data` that hold Bangla, up to `chars` characters, whatever the order
    of the sources (English first would otherwise use up the budget)."""
    texts, total = [], 0
    for path in (p for source in resolve_sources(data) for p in source.paths):
        for doc in iter_documents(path):  # lazily: a large corpus is not read whole
            if total >= chars:
                return texts
            if any("\u0980" <= c <= "\u09ff" for c in doc[:2000]):
                texts.append(doc)
                total += len(doc)
    return texts


def _tokenizer(base: Path, data: list[str], run: Path, cfg: AdaptConfig, weights, log) -> dict:
    if cfg.tokenizer == "extend":
        base_json = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
        texts = bangla_texts(data, cfg.tokenizer_chars)
        log(f"tokenizer: learning up to {cfg.new_tokens:,} Bangla tokens (split={cfg.split})")
        return extend(base_json, texts, cfg.new_tokens, cfg.split)
    tcfg = TokenizerConfig(
        style="spm", vocab_size=cfg.spm_vocab_size, max_chars=cfg.tokenizer_chars
    )
    sources = resolve_sources(data)  # mixed by the shares of --weights, as the shards are
    mix = parse_weights(list(weights), sources)
    path = train_tokenizer(sources, tcfg, run / "spm-tokenizer", mix, progress=False, log=log)
    return json.loads(Path(path).read_text(encoding="utf-8"))


def finish_base(pretrained: Path, adapted: Path, out: Path) -> Path:
    """OUT: the pretrained model with the adapted model's tokenizer files, whole or not at all."""
    stage = out.parent / f".{out.name}.writing"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(pretrained, stage)
    keep_tokenizer_files(stage, adapted)
    shutil.rmtree(out, ignore_errors=True)
    stage.rename(out)
    return out


def adapt(
    cfg: AdaptConfig,
    base,
    data: list[str],
    out,
    weights=(),
    chat_data: list[str] = (),
    fresh: bool = False,
    skip_verify: bool = False,
    log=print,
) -> Path:
    """Every stage (the module docstring) in RUN=`out`; returns RUN/final's target."""
    base, run = Path(base), Path(out)
    if not (base / "config.json").is_file() or not (base / "tokenizer.json").is_file():
        raise DoelError(f"{base}: not a model folder; import one with `doel-train import`")
    if fresh:
        shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run / "adapt_config.json", dataclasses.asdict(cfg))
    model, n_base = adapted_model(base, data, run, cfg, weights, log)
    make_shards(model, data, run, cfg.prepare, list(weights), log=log)
    pretrained = continue_pretraining(
        cfg.pretrain, model, run / "shards", run / "pretrain", n_base, log=log,
        skip_verify=skip_verify,
    )  # fmt: skip
    done = finish_base(pretrained, model, run / "base")
    log(f"continued pretraining done: {done}")
    if chat_data:
        done = chat_finetune(cfg.chat, done, list(chat_data), run / "chat", log=log,
                             skip_verify=skip_verify)  # fmt: skip
    final = run / "final"
    if final.is_symlink() or final.exists():
        final.unlink() if final.is_symlink() else shutil.rmtree(final)
    final.symlink_to(done.relative_to(run))
    log(f"adapted model: {final} -> {done}")
    return done
