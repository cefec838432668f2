"""A safetensors file's header, read without trusting it: the header length its first 8 bytes
state is held to the file's size and to MAX_SAFETENSORS_HEADER_BYTES before it is read, each
tensor's shape and data_offsets must be integers of 0 or more, lie within the file and hold what
the shape and dtype need, and the header must describe the whole file. A truncated or damaged
file, or one whose header claims more than it holds, is refused here in one line naming the file
and the field, in a second, not deep inside a graph builder minutes later; only then are the
tensors' shapes given to the checks of config.json (export/claims.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from doel.contracts import untrusted
from doel.export.common import ExportError

# Bytes per element of the safetensors dtypes a language model's weights use; a dtype not listed
# (sub-byte ones) is checked only through the file's total length.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def _safetensors_header(path: Path, size: int) -> tuple[int, dict]:
    """(header length, {tensor: entry}) of a safetensors file, the length its first 8 bytes
    state held to the file's size and to MAX_SAFETENSORS_HEADER_BYTES before it is read;
    ValueError when unreadable."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size >= 8 and n > min(size - 8, untrusted.MAX_SAFETENSORS_HEADER_BYTES):
            what = (
                f"is truncated or not a safetensors file: its header length (the first 8 bytes) "
                f"is {n:,} bytes, more than the {size - 8:,} after it in the file"
                if n > size - 8
                else f"header length (the first 8 bytes) is {n:,} bytes, more than the "
                f"{untrusted.MAX_SAFETENSORS_HEADER_BYTES:,} doel reads"
            )
            raise untrusted.UntrustedError(
                f"{path} {what}; copy it again or save the checkpoint again"
            )
        if size < 8:
            raise ValueError("no room for the header")
        try:
            header = json.loads(f.read(n))  # its errors are ValueErrors
        except RecursionError:
            raise ValueError("header nested too deep") from None
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return n, {k: v for k, v in header.items() if k != "__metadata__"}


def _whole(value) -> int:
    """A JSON integer of 0 or more (a ValueError for "12", 1.5, true, -1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a size")
    return value


def _span(entry: dict) -> tuple[int, int, int]:
    """(begin, end, bytes its shape and dtype need; 0 for a dtype not in DTYPE_BYTES)."""
    begin, end = (_whole(x) for x in entry["data_offsets"])
    return (
        begin,
        end,
        math.prod(_whole(d) for d in entry["shape"]) * DTYPE_BYTES.get(entry["dtype"], 0),
    )


def check_safetensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Parse the header and compare the sizes it states with the file's length: a truncated or
    damaged file is refused here, in a second, not deep inside a graph builder minutes later.
    The shapes of its tensors, by name."""
    again = "copy it again or save the checkpoint again"
    size = path.stat().st_size
    try:
        n, tensors = _safetensors_header(path, size)
        spans = {name: _span(t) for name, t in tensors.items()}
    except untrusted.UntrustedError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ExportError(
            f"{path} is truncated or not a safetensors file (no readable header in its {size} "
            f"bytes); {again}"
        ) from None
    for name, (begin, stop, need) in spans.items():
        if stop < begin or (need and stop - begin != need):
            raise ExportError(
                f"{path} is damaged: tensor {name!r} takes {stop - begin} bytes where its shape "
                f"and dtype need {need}; {again}"
            )
    last = max(spans, key=lambda name: spans[name][1], default=None)
    end = spans[last][1] if last else 0
    if 8 + n + end != size:
        where = f" (the data_offsets of tensor {last!r} end at byte {end})" if last else ""
        raise ExportError(
            f"{path} is truncated or damaged: its header describes {8 + n + end} bytes, the "
            f"file has {size}{where}; {again}"
        )
    return {name: tuple(t["shape"]) for name, t in tensors.items()}
