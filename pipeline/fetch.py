"""The recipe's data stage: each source streamed into local JSONL chunks, resumably.

Layout under RUN/data: `NAME/chunk-NNNNN.jsonl` (training text), `NAME-heldout/chunk-NNNNN.jsonl`
(every `heldout_every`-th document, for validation and evaluation) and `NAME/progress.json`.
A chunk is written whole (temporary file, then rename) before the progress marker counts it, so
a download killed at any moment leaves complete chunks and a marker that agrees with them; the
next run deletes anything past the marker and continues the stream from the marker's position
(a hub dataset's own `state_dict` where `datasets` has it, else the count of rows to skip).

`--dry-run` reads local .txt/.jsonl/.parquet files through the same chunking; `standins` cuts
them from the built-in sample when the user gives none.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from tqdm import tqdm

from doel.contracts import read_json
from doel.train.common import SAMPLE_DIR, DoelError, atomic_write_bytes, atomic_write_json
from doel.train.config import resolved
from doel.train.data.textio import iter_documents, with_field_fix

PROGRESS = "progress.json"
HUB_RETRIES = 3  # a dropped connection reopens the stream at the last chunk this many times
SAMPLE = SAMPLE_DIR


def chunk_name(i: int) -> str:
    return f"chunk-{i:05d}.jsonl"


def _open_hub(src, state: dict):
    """(rows' texts, a function giving the stream's position) for a hub dataset."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise DoelError(
            f"{src.name}: streaming {src.dataset} needs the datasets package: "
            "pip install 'doel[hub]' (or try the recipe with --dry-run)"
        ) from None
    try:
        ds = datasets.load_dataset(
            src.dataset,
            src.config or None,
            data_dir=src.data_dir or None,
            data_files=src.data_files or None,
            split=src.split,
            streaming=True,
        )
    except Exception as e:  # noqa: BLE001 (hub, network and builder errors of many kinds)
        raise DoelError(
            f"{src.name}: cannot open {src.dataset} (config {src.config!r}, split {src.split!r}): "
            f"{type(e).__name__}: {e}. Check the names, the network, and HF_TOKEN for gated "
            "datasets; rerun to continue where it stopped"
        ) from None
    if hasattr(ds, "state_dict"):  # datasets >= 2.18: resumes inside a file, no re-reading
        if state.get("stream_state"):
            ds.load_state_dict(state["stream_state"])
        position = ds.state_dict
    else:
        ds, position = ds.skip(state["documents"]), (lambda: None)
    return (row.get(src.text_field) for row in ds), position


def _open_local(src, path: str, state: dict):

    if not Path(path).is_file():
        raise DoelError(f"--local {src.name}={path}: no such file")
    fix = f'set text_field = "NAME" in the recipe\'s [[sources]] entry {src.name!r}'
    docs = with_field_fix(iter_documents(path, src.text_field), fix)
    return itertools.islice(docs, state["documents"], None), (lambda: None)


def _fresh(spec: dict, target: int) -> dict:
    return {
        "source": spec,
        "target_chars": target,
        "documents": 0,  # rows consumed from the stream, blank ones included
        "chars": 0,
        "heldout_chars": 0,
        "chunks": 0,
        "stream_state": None,
        "exhausted": False,
        "done": False,
    }


def _clean(folders: tuple[Path, Path], chunks: int) -> None:
    """Remove what a killed run left past the marker: temporary files and uncounted chunks."""
    for folder in folders:
        for f in folder.glob(".*.tmp"):
            f.unlink()
        for f in folder.glob("chunk-*.jsonl"):
            if int(f.stem.split("-")[1]) >= chunks:
                f.unlink()


def fetch_source(src, target: int, root: Path, data, local=None, log=print, on_chunk=None) -> dict:
    """Stream `src` into root/NAME until `target` training characters (or its end); return the
    progress marker. Resumes from root/NAME/progress.json; `on_chunk(i)` runs after each
    committed chunk (tests interrupt there)."""

    folder, held = root / src.name, root / f"{src.name}-heldout"
    spec = resolved(src) | {"local": str(local) if local else None}
    marker = folder / PROGRESS
    state = read_json(marker, strict=True)
    if state is not None and state["source"] != spec:
        log(f"  {src.name}: the source changed since the last run; fetching it again")
        state = None
    state = state or _fresh(spec, target)
    state["target_chars"] = target
    if state["exhausted"] or state["chars"] >= target:
        return state | {"done": True}
    folder.mkdir(parents=True, exist_ok=True)
    held.mkdir(parents=True, exist_ok=True)
    _clean((folder, held), state["chunks"])
    if state["chunks"]:
        log(f"  {src.name}: resuming at {state['chars']:,} characters ({state['chunks']} chunks)")
    on_chunk = on_chunk or (lambda chunks: None)
    for attempt in range(1, HUB_RETRIES + 1):
        try:
            return _stream(src, state, folder, held, data, local, marker, on_chunk, tqdm)
        except DoelError:
            raise
        except (OSError, ConnectionError, TimeoutError) as e:
            if local or attempt == HUB_RETRIES:
                raise DoelError(
                    f"{src.name}: the download stopped ({type(e).__name__}: {e}); rerun the "
                    "recipe to continue from the last complete chunk"
                ) from None
            log(f"  {src.name}: {type(e).__name__}: {e}; reopening the stream ({attempt})")
            state = read_json(marker, strict=True) or state
            _clean((folder, held), state["chunks"])
            time.sleep(10 * attempt)
    raise AssertionError("unreachable")


def _write_chunk(folders, marker: Path, cur: dict, docs: tuple, position, exhausted) -> dict:
    """The chunk's files first, then the marker that counts them; returns the new state."""
    name = chunk_name(cur["chunks"])
    for folder, texts in zip(folders, docs):
        if texts:
            lines = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
            atomic_write_bytes(folder / name, lines.encode("utf-8"))
    cur["chunks"] += 1
    cur["stream_state"] = position()
    cur["exhausted"] = exhausted
    cur["done"] = exhausted or cur["chars"] >= cur["target_chars"]
    atomic_write_json(marker, cur)
    return dict(cur)


def _stream(src, state, folder, held, data, local, marker, on_chunk, tqdm) -> dict:
    texts, position = _open_local(src, local, state) if local else _open_hub(src, state)
    cur = dict(state)  # counters of the chunk being filled; `state` only moves on commit
    train, heldout, in_chunk, exhausted = [], [], 0, True
    bar = tqdm(
        total=cur["target_chars"], initial=cur["chars"], unit="char", unit_scale=True, desc=src.name
    )
    for text in texts:
        cur["documents"] += 1
        if not isinstance(text, str) or not text.strip():
            continue
        text = text.strip()
        if cur["documents"] % data.heldout_every == 0 and (
            cur["heldout_chars"] < data.heldout_max_chars
        ):
            heldout.append(text)
            cur["heldout_chars"] += len(text)
            continue
        train.append(text)
        cur["chars"] += len(text)
        in_chunk += len(text)
        bar.update(len(text))
        if cur["chars"] >= cur["target_chars"]:
            exhausted = False
            break
        if in_chunk >= data.chunk_chars:
            state = _write_chunk((folder, held), marker, cur, (train, heldout), position, False)
            train, heldout, in_chunk = [], [], 0
            on_chunk(state["chunks"])
    state = _write_chunk((folder, held), marker, cur, (train, heldout), position, exhausted)
    bar.close()
    on_chunk(state["chunks"])
    return state


def fetch_all(recipe, local: dict, root: Path, log=print, on_chunk=None) -> dict[str, dict]:
    """Every source of the recipe (from `local[name]` where given); a source that ends before
    its target is reported."""
    out = {}
    for src in recipe.sources:
        target = recipe.corpus_chars[src.name]
        out[src.name] = fetch_source(
            src, target, root, recipe.data, local.get(src.name), log, on_chunk
        )
        got = out[src.name]["chars"]
        status = "complete" if got >= target else "SHORT: the source ended"
        log(f"  {src.name}: {got:,} of {target:,} characters ({status})")
    return out


def corpus(recipe, root: Path, progress: dict[str, dict]) -> dict:
    """The fetched text as the later stages take it: training folders, the character shares
    for `prepare` (the recipe's, or what each source gave when one ran short), and the
    held-out folders, and their files by language."""
    sources = recipe.sources
    short = any(p["chars"] < recipe.corpus_chars[n] for n, p in progress.items())
    total = sum(p["chars"] for p in progress.values()) or 1
    shares = {s.name: (progress[s.name]["chars"] / total if short else s.share) for s in sources}
    heldout: dict[str, list[str]] = {}
    dirs = []
    for s in sources:
        files = sorted(str(f) for f in (root / f"{s.name}-heldout").glob("chunk-*.jsonl"))
        heldout.setdefault(s.language, []).extend(files)
        dirs += [str(root / f"{s.name}-heldout")] if files else []
    return {
        "train": [str(root / s.name) for s in sources if progress[s.name]["chars"]],
        "weights": [f"{n}={v}" for n, v in shares.items() if progress[n]["chars"]],
        "heldout": {lang: files for lang, files in heldout.items() if files},
        "heldout_dirs": dirs,
        "short": short,
    }


def standins(recipe, folder: Path, given: dict) -> dict[str, str]:
    """Local files standing in for the hub sources without one in `given`: paragraphs of the
    built-in sample in the source's language, shared out by the sources' shares (no paragraph
    twice, so deduplication and the overlap check see what real data gives them), written as
    .jsonl, .parquet and .txt in turn with the source's text field."""

    todo = [s for s in recipe.sources if s.name not in given]
    out = dict(given)
    for lang in sorted({s.language for s in todo}):
        group = [s for s in todo if s.language == lang]
        sample = SAMPLE / ("bn.txt" if lang == "bn" else "en.txt")
        taken = {s.name: [] for s in group}
        for doc in iter_documents(str(sample)):
            name = min(taken, key=lambda n: sum(map(len, taken[n])) / _share(recipe, n))
            taken[name].append(doc)
        for s in group:
            i = recipe.sources.index(s)
            out[s.name] = str(_write_standin(folder, s, taken[s.name], i % 3))
    return out


def _share(recipe, name: str) -> float:
    return next(s.share for s in recipe.sources if s.name == name)


def _write_standin(folder: Path, src, docs: list[str], kind: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if kind == 1:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ModuleNotFoundError:
            kind = 0  # the train extra brings pyarrow; without it, JSONL
        else:
            path = folder / f"{src.name}.parquet"
            pq.write_table(pa.table({src.text_field: docs}), path)
            return path
    if kind == 0:
        path = folder / f"{src.name}.jsonl"
        rows = "".join(json.dumps({src.text_field: d}, ensure_ascii=False) + "\n" for d in docs)
        atomic_write_bytes(path, rows.encode("utf-8"))
        return path
    path = folder / f"{src.name}.txt"  # paragraphs separated by blank lines
    atomic_write_bytes(path, ("\n\n".join(docs) + "\n").encode("utf-8"))
    return path
