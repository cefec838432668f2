"""Frozen config dataclasses loaded from TOML with `--set key=value` overrides.

Each dataclass validates itself in __post_init__ and names the offending field, so a typo in a
config file fails before any work starts. `resolved()` gives the dict that is saved beside every
artifact.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from train.common import DoelError

T = TypeVar("T")


def _coerce(value: str, annotation: Any) -> Any:
    """Parse a --set value by the field's declared type (TOML literal syntax where it helps)."""
    text = str(annotation)
    if "bool" in text:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {value!r}")
    if "int" in text and "float" not in text:
        return int(value)
    if "float" in text:
        return float(value)
    if value.lower() == "none" and "None" in text:
        return None
    return value


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Build `cls` from an optional TOML file plus `key=value` overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DoelError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise DoelError(f"{path}: not valid TOML ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise DoelError(f"{path}: unknown config keys {unknown}; known: {sorted(fields)}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise DoelError(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        try:
            values[key] = _coerce(raw, hints[key])
        except ValueError as e:
            raise DoelError(f"--set {key}: {e}") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise DoelError(f"invalid config: {e}") from None


def resolved(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
