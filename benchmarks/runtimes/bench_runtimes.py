"""Which runtimes read doel's default model exactly, each row produced by the runtime itself.

Every module of this package but this one exposes `rows(work) -> list[dict]`: it runs one outside
tool (onnxruntime-genai's own tokenizer and generator, Go's text/template on the Modelfile's
TEMPLATE, llama-server's `/apply-template` and its streams, transformers, the runtimes' stops at
the end of a document) on models and text made here, and says what it found. This module runs
them all and writes one table, so a claim of reach is a row some tool printed, never doel's
code reading doel's files. A module whose tool is missing gives one row saying so (not ok).

    python -m benchmarks.runtimes.bench_runtimes [--only genai,ollama] [--work DIR]

With `--only`, the other modules' rows are kept from the table already written, each marked with
the date and CPU class of the run that made it, so one module can be rerun alone.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import tempfile
import time
import traceback
from pathlib import Path

import benchmarks.runtimes as package
from benchmarks.common.report import cpu_line, heading, load_line, parser, publish, stamp

RESULTS = ("runtimes",)


def modules() -> list[str]:
    """The row modules of this package, in name order (this one excluded)."""
    names = [m.name for m in pkgutil.iter_modules(package.__path__)]
    return sorted(n for n in names if n != "bench_runtimes")


def gather(names: list[str], work: Path) -> list[dict]:
    """Each module's rows, with the seconds it took; a module that fails gives a row naming why."""
    out = []
    for name in names:
        start = time.perf_counter()
        try:
            found = importlib.import_module(f"benchmarks.runtimes.{name}").rows(work / name)
        except Exception as e:  # a broken check is a row of the table, not a lost table
            traceback.print_exc()
            found = [
                {"runtime": name, "version": "?", "check": "the check ran", "ok": False}
                | {"result": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            ]
        seconds = round(time.perf_counter() - start, 1)
        out += [{"module": name, "seconds": seconds, **row} for row in found]
    return out


def kept_rows(out: Path, names: list[str]) -> list[dict]:
    """The rows of the earlier runtimes.json in `out` whose module is not in `names`, each with
    the run that made it ("2026-12-04, intel-avx512-vnni") where it had none yet."""
    path = Path(out) / "runtimes.json"
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text(encoding="utf-8"))
    run = f"{earlier.get('date', '?')}, {earlier.get('cpu', {}).get('class', '?')}"
    return [{"run": run} | r for r in earlier.get("rows", []) if r.get("module") not in names]


def _cell(value) -> str:
    """A table cell: the text with its pipes escaped (`<|end|>`) and on one line."""
    return " ".join(str(value).split()).replace("|", "\\|")


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = heading("Runtimes that read doel's models", result)
    lines += [
        cpu_line(result["cpu"]),
        "",
        "Each row was produced by the outside tool named, at the version shown, on models and text",
        "made by the module in the last column (`benchmarks/runtimes/`). ok = the runtime agrees",
        "with doel exactly.",
        "",
        "| runtime | version | check | result | ok | module |",
        "|---|---|---|---|:-:|---|",
    ]
    for r in rows:
        cells = [_cell(r[k]) for k in ("runtime", "version", "check", "result")]
        run = f" (run {r['run']})" if r.get("run") else ""
        cells += ["yes" if r["ok"] else "**no**", f"`{r['module']}`{run}"]
        lines.append("| " + " | ".join(cells) + " |")
    bad = sum(not r["ok"] for r in rows)
    lines += ["", f"{len(rows) - bad} of {len(rows)} rows ok; {result['load']}.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, work="scratch folder for the models and tools (default: a temporary one)")
    every = ", ".join(modules())
    ap.add_argument("--only", help=f"comma-separated modules (default: all of {every})")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else modules()
    with tempfile.TemporaryDirectory(prefix="doel-runtimes-") as tmp:
        work = Path(args.work or tmp)
        result = {**stamp(python=True), "rows": gather(names, work)}
    if args.only:
        result["rows"] += kept_rows(args.out, names)
    result["load"] = load_line()
    publish(args.out, "runtimes", result, markdown(result))


if __name__ == "__main__":
    main()
