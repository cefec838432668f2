"""Read documents from .txt, .jsonl and .parquet files, folders of them, or `hf:NAME[:CONFIG]`.

A .txt file holds one document a line, or, when it has blank lines, one document a block of
lines separated by blank lines. Every reader yields stripped, non-empty strings; bad input
raises DoelError with the file, the place and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from doel.train.common import DoelError

SUFFIXES = (".txt", ".jsonl", ".parquet")
# How `doel-train tokenizer` and `prepare` take another field (TokenizerConfig/PrepareConfig).
FIELD_FIX = "name the field with --set text_field=NAME"


class MissingTextField(DoelError):
    """A JSONL record or Parquet file without the text field. `fix` says how the command at
    hand takes another field name (each command names it its own way)."""

    def __init__(self, where: str, fix: str = FIELD_FIX):
        self.where, self.fix = where, fix
        super().__init__(f"{where}; {fix}")

    def __reduce__(self):  # pickled whole (the message alone would repeat the fix)
        return type(self), (self.where, self.fix)


def with_field_fix(docs: Iterator[str], fix: str) -> Iterator[str]:
    """`docs`, with a missing text field reported with `fix` instead of the default."""
    try:
        yield from docs
    except MissingTextField as e:
        raise MissingTextField(e.where, fix) from None


@dataclass(frozen=True)
class Source:
    """One named input of a corpus: a file, the files of a folder, or a hub dataset."""

    name: str
    paths: tuple[str, ...]


def resolve_sources(specs: list[str]) -> list[Source]:
    """Turn command-line data arguments into named sources; every file must exist."""
    sources = []
    for spec in specs:
        if spec.startswith("hf:"):
            sources.append(Source(spec[3:], (spec,)))
            continue
        p = Path(spec)
        if p.is_dir():
            files = sorted(str(f) for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
            if not files:
                raise DoelError(f"folder {spec} holds no {', '.join(SUFFIXES)} files")
            sources.append(Source(p.name, tuple(files)))
        elif p.is_file():
            # Any suffix other than .jsonl/.parquet is read as plain text (.txt, .tokens, .bn...).
            sources.append(Source(p.stem, (str(p),)))
        else:
            raise DoelError(
                f"no such file or folder: {spec} (pass .txt/.jsonl/.parquet files, a folder "
                "of them, or hf:NAME[:CONFIG] for a Hugging Face dataset)"
            )
    # Names key the mixture weights and meta.json, so they must be unique: on a clash, fall
    # back to the file name, then parent/file name, then the path as given.
    for rename in (
        lambda s: Path(s.paths[0]).name,
        lambda s: f"{Path(s.paths[0]).parent.name}/{Path(s.paths[0]).name}",
        lambda s: s.paths[0],
    ):
        names = [s.name for s in sources]
        clash = {n for n in names if names.count(n) > 1}
        sources = [Source(rename(s), s.paths) if s.name in clash else s for s in sources]
    return sources


def iter_source(source: Source, text_field: str = "text") -> Iterator[str]:
    for path in source.paths:
        yield from iter_documents(path, text_field)


def iter_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of one file (or `hf:` dataset)."""
    if path.startswith("hf:"):
        yield from _iter_hf(path[3:], text_field)
    elif path.endswith(".jsonl"):
        yield from _iter_jsonl(path, text_field)
    elif path.endswith(".parquet"):
        yield from _iter_parquet(path, text_field)
    else:
        yield from _iter_txt(path)


def _decode(raw: bytes, path: str, offset: int, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DoelError(
            f"{path}: invalid UTF-8 at byte {offset + e.start} (line {lineno}); convert the "
            "file first, e.g. `iconv -f WINDOWS-1252 -t UTF-8 in.txt > out.txt`"
        ) from None


def _utf16(head: bytes) -> bool:
    """UTF-16 (Windows' "Unicode"): a byte-order mark, or NUL bytes all at odd or all at even
    offsets (the high byte of ASCII characters). Bangla alone has no NUL in UTF-16, but its
    spaces and newlines do."""
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return True
    even, odd = head[0::2].count(0), head[1::2].count(0)
    return (even == 0) != (odd == 0)


def _iter_txt(path: str) -> Iterator[str]:
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    if _utf16(head):
        raise DoelError(
            f"{path}: UTF-16 text, not UTF-8; convert it first, e.g. "
            "`iconv -f UTF-16 -t UTF-8 in.txt > out.txt` (or save it as UTF-8 in your editor)"
        )
    if b"\0" in head:
        raise DoelError(
            f"{path}: looks binary (NUL bytes), not text; pass .txt, .jsonl or .parquet"
        )
    # A blank line anywhere in the first MiB means paragraphs are separated by blank lines.
    by_block = b"\n\n" in head.replace(b"\r\n", b"\n")
    block: list[str] = []
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, offset, lineno).rstrip("\r\n")
            offset += len(raw)
            if not by_block:
                if line.strip():
                    yield line.strip()
            elif line.strip():
                block.append(line)
            elif block:
                yield "\n".join(block).strip()
                block = []
    if block:
        yield "\n".join(block).strip()


def _iter_jsonl(path: str, field: str) -> Iterator[str]:
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, offset, lineno)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DoelError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise MissingTextField(f"{path}:{lineno}: no {field!r} field (found {keys})")
            text = obj[field]
            if isinstance(text, str) and text.strip():
                yield text.strip()


def _iter_parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise MissingTextField(f"{path}: no {field!r} column (found {pf.schema_arrow.names})")
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text.strip()


def _iter_hf(spec: str, field: str) -> Iterator[str]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise DoelError(
            "reading hf:NAME needs the datasets package: pip install datasets"
        ) from None
    name, _, config = spec.partition(":")
    ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    for row in ds:
        text = row.get(field)
        if isinstance(text, str) and text.strip():
            yield text.strip()
