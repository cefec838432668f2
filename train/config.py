"""Frozen config dataclasses loaded from TOML with `--set key=value` overrides.

Each dataclass validates itself in __post_init__ and names the offending field, so a typo in a
config file fails before any work starts. `resolved()` gives the dict that is saved beside every
artifact.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from doel.train.cliparse import did_you_mean
from doel.train.common import DoelError

T = TypeVar("T")
PACKAGE = Path(__file__).resolve().parent  # the installed `doel.train` package


def shipped_dirs(name: str, package: Path = PACKAGE) -> tuple[Path, ...]:
    """Where the shipped `name` folder (configs, recipes) is: inside the installed package (the
    wheel force-includes configs as doel/train/configs, recipes as doel/pipeline/recipes), else
    at the top of a source checkout (an editable install), never a site-packages/NAME that
    another wheel could make."""
    checkout = package.parent
    beside = (checkout / name,) if (checkout / "pyproject.toml").is_file() else ()
    return (package / name, *beside)


CONFIG_DIRS = shipped_dirs("configs")  # presets


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


def from_values(cls: type[T], values: dict[str, Any], where: str) -> T:
    """Construct `cls` from a dict, recursing into fields that are dataclasses themselves."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        hint = did_you_mean(unknown[0], sorted(fields))
        raise DoelError(f"{where}: unknown config keys {unknown}; known: {sorted(fields)}{hint}")
    kwargs = {}
    for key, value in values.items():
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise DoelError(f"{where}: {key} must be a table ([{key}])")
            value = from_values(hints[key], value, f"{where} [{key}]")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise DoelError(f"invalid config ({where}): {e}") from None


def apply_override(values: dict[str, Any], cls: type, item: str) -> None:
    """Apply one `a.b=value` override to the nested dict `values`, typed by `cls`'s fields."""
    dotted, sep, raw = item.partition("=")
    keys = dotted.split(".")
    target, owner = values, cls
    for i, key in enumerate(keys):
        hints = typing.get_type_hints(owner) if dataclasses.is_dataclass(owner) else {}
        if not sep or key not in hints:
            known = sorted(hints)
            if sep and (hint := did_you_mean(key, known)):  # the likely fix before the list
                raise DoelError(f"--set {item!r}: no key {key!r}{hint} (keys: {known})")
            raise DoelError(f"--set {item!r}: expected KEY=VALUE with KEY one of {known}")
        if i == len(keys) - 1:
            if dataclasses.is_dataclass(hints[key]):
                raise DoelError(f"--set {item!r}: {key} is a table; set one of its fields")
            try:
                target[key] = _coerce(raw, hints[key])
            except ValueError as e:
                raise DoelError(f"--set {dotted}: {e}") from None
        else:
            target = target.setdefault(key, {})
            owner = hints[key]


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Build `cls` from an optional TOML file (or the .json of a resolved config that a run
    recorded) plus `key=value` (or `table.key=value`) overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        kind = "JSON" if Path(path).suffix == ".json" else "TOML"
        try:
            text = Path(path).read_text(encoding="utf-8")
            values = json.loads(text) if kind == "JSON" else tomllib.loads(text)
        except FileNotFoundError:
            raise DoelError(f"config file not found: {path}") from None
        except (OSError, ValueError) as e:  # TOMLDecodeError and JSONDecodeError among them
            raise DoelError(f"{path}: not valid {kind} ({e})") from None
        if not isinstance(values, dict):
            raise DoelError(f"{path}: not a table of settings")
    for item in overrides:
        apply_override(values, cls, item)
    return from_values(cls, values, str(path) if path else "config")


def resolved(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def presets() -> list[str]:
    """The names of the shipped training presets (configs/NAME.toml)."""
    return sorted({p.stem for d in CONFIG_DIRS if d.is_dir() for p in d.glob("*.toml")})


def resolve_config(name: str | None) -> Path | None:
    """A TOML path, or a preset name from configs/ (tiny, small, bangla-0.4b, demo)."""
    if name is None or Path(name).is_file():
        return Path(name) if name else None
    for folder in CONFIG_DIRS:
        if (folder / f"{name}.toml").is_file():
            return folder / f"{name}.toml"
    raise DoelError(f"config {name!r} is neither a file nor a preset; presets: {presets()}")
