"""The rented-GPU recipe as a file: `recipes/NAME/recipe.toml` → validated frozen dataclasses.

A recipe names the data (Hugging Face datasets with shares of characters), the tokenizer and
shard settings, the training preset and its overrides, the evaluation tasks, the export targets
and the hourly price. `load_recipe` reads it (errors name the field), `make_plan` turns it into
what the stages run: the training config with its steps derived from the token budget, the
characters to fetch from each source, the task files found. `--dry-run` is the same recipe with
its `[dry_run]` overrides (tiny model, local files, CPU). The stages are in pipeline/runner.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from doel.contracts.quant import DEFAULT_ONNX, names
from doel.train.checks.base import VerifyConfig
from doel.train.common import DoelError
from doel.train.config import (
    apply_override,
    from_values,
    load_config,
    resolve_config,
    resolved,
    shipped_dirs,
)
from doel.train.data.prepare import PrepareConfig
from doel.train.data.tokenizer import TokenizerConfig
from doel.train.settings import TrainConfig

RECIPE_DIRS = shipped_dirs("recipes", Path(__file__).resolve().parent)
BOOKKEEPING = (  # TrainConfig fields that leave the trained weights as they are
    "hourly_price", "eval_task", "eval_task_limit", "log_every", "eval_every", "eval_batches",
    "checkpoint_every", "keep_checkpoints", "dist_timeout", "dist_setup_timeout",
)  # fmt: skip
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a folder name on every system


def _tuple(obj, name: str) -> None:
    """TOML arrays arrive as lists; frozen configs hold tuples."""
    value = getattr(obj, name)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of strings, got {value!r}")
    object.__setattr__(obj, name, tuple(value))


def _key_values(items: tuple[str, ...], name: str) -> None:
    bad = [s for s in items if "=" not in s]
    if bad:
        raise ValueError(f"{name}: expected KEY=VALUE items, got {bad}")


@dataclass(frozen=True)
class HubSource:
    """One `[[sources]]` entry: a dataset streamed from the Hugging Face hub."""

    name: str  # names the local folder and the source in meta.json
    dataset: str  # e.g. "wikimedia/wikipedia"
    share: float  # share of the corpus characters
    language: str = "bn"  # groups held-out text for evaluation
    config: str = ""  # the dataset's configuration, e.g. "20231101.bn"
    data_dir: str = ""  # a folder inside the dataset repository, e.g. "verified/ben"
    data_files: str = ""  # a glob inside it, e.g. "sample/10BT/*.parquet"
    split: str = "train"
    text_field: str = "text"

    def __post_init__(self):
        if not _NAME.match(self.name or ""):
            raise ValueError(f"name {self.name!r}: use letters, digits, '.', '_', '-'")
        if not self.dataset:
            raise ValueError(f"{self.name}: dataset is empty; give a hub name like owner/name")
        if not isinstance(self.share, (int, float)) or not self.share > 0:
            raise ValueError(f"{self.name}: share must be > 0, got {self.share!r}")
        if not re.fullmatch(r"[a-z]{2,3}", self.language):
            raise ValueError(f"{self.name}: language must be an ISO code like bn or en")
        if not self.split or not self.text_field:
            raise ValueError(f"{self.name}: split and text_field must not be empty")


@dataclass(frozen=True)
class DataSpec:
    chars_per_token: float = 4.0  # sizes the download: characters = corpus tokens x this
    corpus_tokens: int = 0  # tokens of text to fetch; 0: the token budget (one epoch)
    heldout_every: int = 1000  # every Nth document of a source is held out
    heldout_max_chars: int = 2_000_000  # per source
    chunk_chars: int = 50_000_000  # characters a chunk file

    def __post_init__(self):
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.corpus_tokens < 0:
            raise ValueError(f"corpus_tokens must be >= 0, got {self.corpus_tokens}")
        for name in ("heldout_every", "heldout_max_chars", "chunk_chars"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 2:
                raise ValueError(f"{name} must be an integer >= 2, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class TrainSpec:
    preset: str = "bangla-0.4b"  # a configs/ preset or a TOML file
    set: tuple[str, ...] = ()  # KEY=VALUE overrides of the preset
    measure_steps: int = 10
    measure_warmup: int = 3

    def __post_init__(self):
        _tuple(self, "set")
        _key_values(self.set, "set")
        if self.measure_steps < 1 or self.measure_warmup < 1:
            raise ValueError("measure_steps and measure_warmup must be >= 1")


@dataclass(frozen=True)
class EvalSpec:
    task_dir: str = "eval"
    tasks: dict = field(default_factory=dict)  # name -> file or folder inside task_dir
    periodic_task: str = ""  # one of tasks, scored at every validation
    task_limit: int = 1000  # first N items of each task; 0: all
    max_chars: int = 2_000_000
    max_new_tokens: int = 40

    def __post_init__(self):
        if not all(isinstance(v, str) and v for v in self.tasks.values()):
            raise ValueError(f"tasks must map names to paths, got {self.tasks!r}")
        if self.periodic_task and self.periodic_task not in self.tasks:
            raise ValueError(f"periodic_task {self.periodic_task!r} is not in [eval.tasks]")
        if self.task_limit < 0 or self.max_chars < 1 or self.max_new_tokens < 1:
            raise ValueError("task_limit must be >= 0, max_chars and max_new_tokens >= 1")


@dataclass(frozen=True)
class ExportSpec:
    quants: tuple[str, ...] = (DEFAULT_ONNX, "int8")  # ONNX rows of doel.contracts.quant
    mobile: tuple[str, ...] = (DEFAULT_ONNX,)  # bundles that also get model.ort
    eval_tokens: int = 4096

    def __post_init__(self):
        _tuple(self, "quants")
        _tuple(self, "mobile")
        if bad := [q for q in self.quants if q not in names("onnx")]:
            raise ValueError(f"quants: {bad} unknown; choose from {names('onnx')}")
        if bad := [q for q in self.mobile if q not in self.quants]:
            raise ValueError(f"mobile: {bad} are not in quants {self.quants}")
        if self.eval_tokens < 16:
            raise ValueError(f"eval_tokens must be >= 16, got {self.eval_tokens}")


@dataclass(frozen=True)
class SftSpec:
    """The optional chat fine-tuning after pre-training (`doel-train sft`): conversations from
    the hub, the training preset with `set` overrides (SFTConfig's fields too,
    train/data/conversations.py). A dry run reads the shipped sample (train/sample/chat.jsonl)
    instead of `data`."""

    enabled: bool = False
    data: tuple[str, ...] = ()  # hf:NAME[:CONFIG] or files, as `doel-train sft --data` takes
    set: tuple[str, ...] = ()  # KEY=VALUE overrides of the training preset for the SFT run
    dry_run_set: tuple[str, ...] = ()  # added in a dry run

    def __post_init__(self):
        for name in ("data", "set", "dry_run_set"):
            _tuple(self, name)
        _key_values(self.set + self.dry_run_set, "sft.set/dry_run_set")
        if self.enabled and not self.data:
            raise ValueError("sft.data: name the conversations (hf:NAME or files) or disable sft")


@dataclass(frozen=True)
class DryRunSpec:
    set: tuple[str, ...] = ()  # recipe overrides, e.g. "train.preset=tiny"
    train_set: tuple[str, ...] = ()  # added to train.set
    local: dict = field(default_factory=dict)  # source or task name -> local file

    def __post_init__(self):
        _tuple(self, "set")
        _tuple(self, "train_set")
        _key_values(self.set + self.train_set, "set/train_set")


@dataclass(frozen=True)
class Recipe:
    name: str
    token_budget: int
    sources: tuple[HubSource, ...]
    hourly_price: float = 3.0
    data: DataSpec = field(default_factory=DataSpec)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    train: TrainSpec = field(default_factory=TrainSpec)
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # the suite's thresholds
    eval: EvalSpec = field(default_factory=EvalSpec)
    export: ExportSpec = field(default_factory=ExportSpec)
    sft: SftSpec = field(default_factory=SftSpec)
    dry_run: DryRunSpec = field(default_factory=DryRunSpec)

    def __post_init__(self):
        if not _NAME.match(self.name or ""):
            raise ValueError(f"name {self.name!r}: use letters, digits, '.', '_', '-'")
        if not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise ValueError(f"token_budget must be a positive integer, got {self.token_budget!r}")
        if not self.hourly_price >= 0:
            raise ValueError(f"hourly_price must be >= 0, got {self.hourly_price}")
        if not self.sources:
            raise ValueError("sources: the recipe names no data ([[sources]] tables)")
        names = [s.name for s in self.sources]
        if len(set(names)) < len(names) or any(n.endswith("-heldout") for n in names):
            raise ValueError(f"sources: names must be unique and not end in -heldout: {names}")
        total = sum(s.share for s in self.sources)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"sources: the shares add up to {total:g}; make them add up to 1")
        if self.prepare.val_fraction:
            raise ValueError("prepare.val_fraction: leave it 0; held-out text is data.heldout_*")

    @property
    def corpus_chars(self) -> dict[str, int]:
        """Characters to fetch from each source."""
        tokens = self.data.corpus_tokens or self.token_budget
        return {
            s.name: math.ceil(s.share * tokens * self.data.chars_per_token) for s in self.sources
        }


def resolve_recipe(name: str) -> Path:
    """A recipe.toml path, a folder holding one, or a name from recipes/."""
    for p in (Path(name), Path(name) / "recipe.toml"):
        if p.is_file():
            return p
    for folder in RECIPE_DIRS:
        if (folder / name / "recipe.toml").is_file():
            return folder / name / "recipe.toml"
    known = sorted(
        {p.parent.name for d in RECIPE_DIRS if d.is_dir() for p in d.glob("*/recipe.toml")}
    )
    raise DoelError(f"recipe {name!r} is neither a file nor a recipe folder; recipes: {known}")


def load_recipe(path, overrides=(), dry_run: bool = False) -> Recipe:
    """Read a recipe; `overrides` are KEY=VALUE items (table.key for nested fields). With
    dry_run, the recipe's [dry_run] overrides come first, then `overrides`."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DoelError(f"recipe not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise DoelError(f"{path}: not valid TOML ({e})") from None
    recipe = _from_values(raw, path, overrides)
    if dry_run:
        recipe = _from_values(raw, path, [*recipe.dry_run.set, *overrides])
        train = dataclasses.replace(recipe.train, set=recipe.train.set + recipe.dry_run.train_set)
        recipe = dataclasses.replace(recipe, train=train)
    return recipe


def _from_values(raw: dict, path: Path, overrides) -> Recipe:
    values = {k: v for k, v in raw.items() if k != "sources"}
    for item in overrides:
        apply_override(values, Recipe, item)
    sources = raw.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise DoelError(f"{path}: sources must be [[sources]] tables")
    values["sources"] = tuple(
        from_values(HubSource, s, f"{path} [[sources]] #{i + 1}") for i, s in enumerate(sources)
    )
    return from_values(Recipe, values, str(path))


@dataclass(frozen=True)
class Plan:
    """What the stages run, derived from a recipe and the command line."""

    recipe: Recipe
    out: Path
    dry_run: bool
    gpus: int
    yes: bool
    preset: Path  # the training preset's TOML
    train_sets: tuple[str, ...]  # its overrides, as `doel-train fit --set` takes them
    train_cfg: object  # the resolved TrainConfig
    local: dict  # source/task name -> local file (dry run)
    tasks: dict  # task name -> path, the ones found
    missing_tasks: dict  # task name -> path, the ones not found
    hub_tasks: dict = field(default_factory=dict)  # task name -> hf: spec (the data stage fetches)

    def resolved(self) -> dict:
        """What this run was asked to do, saved as RUN/recipe.json."""
        keep = ("dry_run", "gpus", "train_sets", "local", "tasks", "missing_tasks", "hub_tasks")
        return (
            {"recipe": resolved(self.recipe), "preset": str(self.preset)}
            | {k: getattr(self, k) for k in keep}
            | {"train": resolved(self.train_cfg)}
        )

    def fingerprint_of(self, *parts) -> dict:
        """The resolved settings a stage depends on: recipe tables by name, "train" the
        resolved training config without what changes what is logged, scored or kept but
        not the weights (so adding task files later does not restart training)."""
        train = resolved(self.train_cfg)
        for key in BOOKKEEPING:
            train.pop(key)
        values = resolved(self.recipe) | {"train": train, "gpus": self.gpus}
        return {p: values[p] for p in parts}


def make_plan(recipe: Recipe, out, dry_run=False, gpus=1, yes=False, local=None, eval_dir=None):
    """Resolve the training config (steps from the token budget at the global batch) and the
    task files. With gpus > 1 the global batch stays the preset's: grad_accum (or batch_size)
    is divided."""

    preset = resolve_config(recipe.train.preset)
    sets = list(recipe.train.set) + [f"model.vocab_size={recipe.tokenizer.vocab_size}"]
    base = load_config(TrainConfig, preset, sets)
    if gpus > 1:  # fewer micro-batches a GPU, else smaller ones
        if base.grad_accum % gpus == 0:
            sets.append(f"grad_accum={base.grad_accum // gpus}")
            if base.batch_ramp_fraction and base.grad_accum // gpus < 2:
                # The ramp splits a GPU's micro-batches into smaller updates; with one a GPU
                # there is nothing to split, and the preset's run is the same without it.
                sets.append("batch_ramp_fraction=0")
        elif base.batch_size % gpus == 0:
            sets.append(f"batch_size={base.batch_size // gpus}")
        else:
            raise DoelError(
                f"--gpus {gpus}: neither grad_accum ({base.grad_accum}) nor batch_size "
                f"({base.batch_size}) of the preset divides by it, so the global batch would "
                "change; set one that does in the recipe's train.set"
            )
    per_step = base.batch_size * base.grad_accum * base.seq_len  # global: same for any gpus
    sets += [f"steps={math.ceil(recipe.token_budget / per_step)}"]
    sets += [f"hourly_price={recipe.hourly_price}"]
    local = {**(recipe.dry_run.local if dry_run else {}), **(local or {})}
    task_dir = Path(eval_dir or recipe.eval.task_dir)
    tasks, missing, hub = {}, {}, {}
    for name, rel in recipe.eval.tasks.items():
        if rel.startswith("hf:"):  # fetched from the hub (or --local) by the data stage
            hub[name] = rel
            continue
        path = Path(local.get(name) or task_dir / rel)
        (tasks if path.exists() else missing)[name] = str(path)
    if recipe.eval.periodic_task in tasks:
        sets.append(f"eval_task={recipe.eval.periodic_task}={tasks[recipe.eval.periodic_task]}")
        sets.append(f"eval_task_limit={recipe.eval.task_limit or 1_000_000}")
    cfg = load_config(TrainConfig, preset, sets)
    return Plan(
        recipe, Path(out), dry_run, gpus, yes, preset, tuple(sets), cfg, local, tasks, missing, hub
    )
