"""Task sets from the Hugging Face hub: `NAME=hf:OWNER/DATASET[:CONFIG][@SPLIT]` on the command
line and in a recipe's [eval.tasks], fetched once into a local JSONL file of the dataset's own
rows (every column, as the hub has them), which train/evals/tasks.py then reads like any file.

The split (and config) default to what the TituLLM suite's lm-eval tasks score (hishab-nlp's
fork of lm-evaluation-harness, lm_eval/tasks/*_bn/*.yaml and bangla_mmlu.yaml), so
`bangla_mmlu=hf:hishab/bangla-mmlu` scores the same items as its published results.
hishab/titulm-bangla-mmlu has one config a subject (its bnmmlu_*.yaml tasks): name one, e.g.
`hf:hishab/titulm-bangla-mmlu:Job_Exams-GK_Bangladesh`.

A fetch is written whole (temporary file, then rename) with a record of what it holds beside
it, so a killed fetch leaves nothing half-written and the next run fetches again; a complete one
is never fetched twice. A set that cannot be fetched (no network, a renamed dataset, no
`datasets` package) is named and left out, never fatal: the other tasks are still scored.
`local` stands a .jsonl/.parquet file in for a hub set (the recipe's dry run, tests, a machine
without the hub): its rows go through the same writer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from doel.train.common import DoelError, atomic_write_bytes, atomic_write_json
from doel.train.evals.tasks import read_jsonl, read_parquet

PREFIX = "hf:"
# dataset -> (config, split) as the TituLLM suite's lm-eval task yamls score them.
SUITE = {
    "hishab/bangla-mmlu": ("", "test"),
    "hishab/titulm-bangla-mmlu": ("", "test"),  # a config a subject: name one
    "hishab/boolq_bn": ("", "validation"),
    "hishab/commonsenseqa-bn": ("", "validation"),
    "hishab/openbookqa-bn": ("", "test"),
    "hishab/piqa-bn": ("", "validation"),
}


def is_hub(path) -> bool:
    return str(path).startswith(PREFIX)


@dataclass(frozen=True)
class HubTask:
    dataset: str
    config: str
    split: str

    @classmethod
    def parse(cls, spec: str) -> HubTask:
        """`hf:OWNER/DATASET[:CONFIG][@SPLIT]`; the suite's config and split by default,
        else "test"."""
        body = spec[len(PREFIX) :] if is_hub(spec) else spec
        body, _, split = body.partition("@")
        dataset, _, config = body.partition(":")
        if dataset.count("/") != 1 or not all(dataset.split("/")):
            raise DoelError(
                f"{spec!r}: expected hf:OWNER/DATASET[:CONFIG][@SPLIT], e.g. hf:hishab/piqa-bn"
            )
        default_config, default_split = SUITE.get(dataset, ("", "test"))
        return cls(dataset, config or default_config, split or default_split)

    @property
    def slug(self) -> str:
        parts = [self.dataset.replace("/", "__"), self.config, self.split]
        return "--".join(p for p in parts if p)


def _hub_rows(task: HubTask) -> Iterable[dict]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise DoelError(
            f"fetching {task.dataset} needs the datasets package: pip install 'doel[hub]'"
        ) from None
    try:
        return datasets.load_dataset(
            task.dataset, task.config or None, split=task.split, streaming=True
        )
    except Exception as e:  # noqa: BLE001 (hub, network and builder errors of many kinds)
        raise DoelError(
            f"cannot open {task.dataset} (config {task.config!r}, split {task.split!r}): "
            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        ) from None


def _local_rows(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise DoelError(f"stand-in {p}: no such file")
    if p.suffix not in (".jsonl", ".parquet"):
        raise DoelError(f"stand-in {p}: expected the dataset's rows as .jsonl or .parquet")
    return read_parquet(p) if p.suffix == ".parquet" else read_jsonl(p)


def fetch_task(task: HubTask, folder: Path, local: str | None = None) -> Path:
    """FOLDER/SLUG.jsonl with every row of the split (from `local` when given); reused when a
    complete fetch of the same set is already there."""
    out, record = folder / f"{task.slug}.jsonl", folder / f"{task.slug}.json"
    want = asdict(task) | {"local": str(local) if local else None}
    if out.is_file() and record.is_file():
        done = json.loads(record.read_text(encoding="utf-8"))
        if {k: done.get(k) for k in want} == want:
            return out
    rows = _local_rows(local) if local else _hub_rows(task)
    try:
        lines = [json.dumps(dict(r), ensure_ascii=False, default=str) + "\n" for r in rows]
    except Exception as e:  # noqa: BLE001 (a stream can fail mid-way in many ways)
        raise DoelError(
            f"{task.dataset}: the download stopped ({type(e).__name__}: {e}); run again to "
            "fetch it whole"
        ) from None
    if not lines:
        raise DoelError(f"{task.dataset} split {task.split!r} has no rows")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, "".join(lines).encode("utf-8"))
    atomic_write_json(record, want | {"rows": len(lines)})
    return out


def fetch_tasks(
    tasks: dict[str, str],
    folder: Path,
    local: dict[str, str] | None = None,
    offline: bool = False,
    log=print,
) -> tuple[dict[str, str], dict[str, str]]:
    """({name: local path}, {name: why it is left out}) for {name: path or hf: spec}: files as
    they are, hub sets fetched into `folder` (from local[name] where given; with `offline`,
    a hub set without one is left out instead of reaching for the network)."""
    local = local or {}
    found, missing = {}, {}
    for name, spec in tasks.items():
        if not is_hub(spec):
            found[name] = spec
            continue
        try:
            task = HubTask.parse(spec)
            if offline and name not in local:
                raise DoelError(f"no stand-in for {spec} offline (--local {name}=FILE)")
            found[name] = str(fetch_task(task, Path(folder), local.get(name)))
        except DoelError as e:
            missing[name] = str(e)
    if missing:
        log(
            "left out (could not be fetched): " + "; ".join(f"{n}: {w}" for n, w in missing.items())
        )
    return found, missing
