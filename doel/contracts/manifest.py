"""The export bundle's manifest.json as a typed, versioned record: export writes it, serve
checks it before it trusts the folder.

A manifest names its `format` ("doel-export"), its `version` (JSON key `format_version`) and its
`kind` ("onnx": a bundle doel-serve runs; "gguf": a file for llama.cpp; "pte": a program for
ExecuTorch; "litertlm": a bundle for LiteRT-LM). Version 1 bundles
(before `kind`) are ONNX bundles. A reader meets a folder it cannot use with a one-line error
that says what the folder is and what to do, never a KeyError. A manifest comes with a folder
that may be a stranger's: its sizes are held to doel.contracts.untrusted's bounds and the files
it names must be names in the folder, not paths, before a reader sizes or opens anything by them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from doel.contracts.untrusted import (
    MAX_CONTEXT,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    UntrustedError,
    plain_name,
    read_record,
    whole,
)

FORMAT = "doel-export"
VERSION = 2  # 2: `kind` added, the GGUF manifest records no absolute path
KINDS = ("onnx", "gguf", "pte", "litertlm")


class ManifestError(ValueError):
    """A folder whose manifest.json this doel cannot use; the message says what to do."""


@dataclass(frozen=True)
class KVCache:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    position_ids_input: bool = False
    past_present_share_buffer: bool = False
    layout: str = ""


@dataclass(frozen=True)
class Manifest:
    """The fields every reader relies on; the rest of the file (inputs, versions, parity...)
    is kept in `extra` and written back as it was."""

    kind: str
    format: str = FORMAT
    version: int = VERSION
    model: str | None = None  # the ONNX graph's file (kind onnx)
    gguf: str | None = None  # the GGUF file (kind gguf)
    quant: str | None = None  # a row of doel.contracts.quant.QUANTS
    vocab_size: int | None = None
    context_length: int | None = None
    kv_cache: KVCache | None = None
    special_tokens: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ManifestError(f"manifest kind {self.kind!r} unknown; one of {KINDS}")
        if self.kind == "onnx" and not (self.model and self.kv_cache and self.vocab_size):
            raise ManifestError("an onnx manifest needs model, kv_cache and vocab_size")
        if self.kind == "gguf" and not self.gguf:
            raise ManifestError("a gguf manifest needs gguf (the file's name)")
        if self.kind in ("pte", "litertlm") and not self.model:
            raise ManifestError(f"a {self.kind} manifest needs model (the file's name)")

    def to_dict(self) -> dict[str, Any]:
        out = {"format": self.format, "format_version": self.version, "kind": self.kind}
        for name in ("model", "gguf", "quant", "vocab_size", "context_length"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.kv_cache is not None:
            out["kv_cache"] = asdict(self.kv_cache)
        if self.special_tokens:
            out["special_tokens"] = self.special_tokens
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "manifest.json") -> Manifest:
        """The manifest in `data`, checked: a ManifestError in one line for anything else."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ManifestError(
                f"{where} is not a doel-export manifest; give a folder written by doel-export"
            )
        version = data.get("format_version", 1)
        if not isinstance(version, int) or version > VERSION:
            raise ManifestError(
                f"{where} is format version {version}, newer than this doel reads ({VERSION}); "
                "upgrade doel (pip install -U doel)"
            )
        kind = data.get("kind", "onnx")  # version 1 wrote only ONNX bundles without a kind
        known = {
            "format",
            "format_version",
            "kind",
            "model",
            "gguf",
            "quant",
            "vocab_size",
            "context_length",
            "kv_cache",
            "special_tokens",
        }
        try:
            kv = data.get("kv_cache")
            manifest = cls(
                kind=kind,
                version=version,
                model=data.get("model"),
                gguf=data.get("gguf"),
                quant=data.get("quant") or (data.get("quantization") or {}).get("quant"),
                vocab_size=_int(data.get("vocab_size")),
                context_length=_int(data.get("context_length")),
                kv_cache=None if kv is None else _kv(kv),
                special_tokens=data.get("special_tokens") or {},
                extra={k: v for k, v in data.items() if k not in known},
            )
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            if isinstance(e, ManifestError):
                raise ManifestError(f"{where}: {e}") from None
            raise ManifestError(
                f"{where} is damaged ({type(e).__name__}: {e}); export the bundle again"
            ) from None
        try:
            _bounded(manifest, where)
        except UntrustedError as e:
            raise ManifestError(str(e)) from None
        return manifest


def _bounded(m: Manifest, where: str) -> None:
    """The sizes a reader allocates by within doel.contracts.untrusted's bounds; the files it
    opens, names in the folder (a bundle is flat)."""
    for name, most in (
        ("vocab_size", MAX_VOCAB),
        ("context_length", MAX_CONTEXT),
    ):
        if getattr(m, name) is not None:
            whole(getattr(m, name), f"{where} {name}", most)
    if m.kv_cache is not None:
        for name, most in (
            ("layers", MAX_LAYERS),
            ("kv_heads", MAX_HEADS),
            ("head_dim", MAX_WIDTH),
        ):
            whole(getattr(m.kv_cache, name), f"{where} kv_cache.{name}", most)
    for name in ("model", "gguf"):
        if getattr(m, name) is not None:
            plain_name(getattr(m, name), f"{where} {name}")
    files = m.extra.get("files")
    for name in files if isinstance(files, dict) else ():
        plain_name(name, f"{where} files")


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _kv(kv: dict) -> KVCache:
    """The cache's shape as numbers (a ValueError for "two" layers: a damaged file), flags as
    booleans; keys a later doel adds are left to the file."""
    names = KVCache.__dataclass_fields__
    cache = KVCache(**{k: v for k, v in kv.items() if k in names})
    sizes = {k: int(getattr(cache, k)) for k in ("layers", "kv_heads", "head_dim")}
    if min(sizes.values()) < 1:
        raise ValueError(f"kv_cache sizes must be positive, got {sizes}")
    return replace(cache, **sizes)


def read_manifest(folder: str | Path) -> Manifest:
    """The checked manifest of an export folder."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise ManifestError(f"{folder} has no manifest.json; give a folder written by doel-export")
    try:
        data = read_record(path)
    except UntrustedError as e:
        raise ManifestError(str(e)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path} is not JSON ({e}); export the bundle again") from None
    return Manifest.from_dict(data, str(path))
