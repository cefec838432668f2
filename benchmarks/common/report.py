"""What every benchmark's result shares: the results folder, the command line's --out and --work,
the date, machine, CPU class and load a result records (stamp), the first lines of its
Markdown, the command that runs another benchmark module in its own interpreter, and the one
writer of a result (publish: JSON, Markdown and a PNG where it draws). In one place so that
every report names its machine and CPU alike and every results file is written whole: a run
stopped midway leaves the last result as it was. tests/benchmarks/test_package.py fails on a
benchmark that writes a result any other way."""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
from datetime import date
from pathlib import Path

from benchmarks.common.cpu_class import isa_summary, this_cpu
from doel.train.common import atomic_write_bytes  # no torch: plain file writes

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
SERVE_WORK = ROOT / "out" / "bench-serve"  # bench_serve.py's models, reused by the probes
SERVE_WORK_HELP = "bench_serve.py's scratch folder (kept and reused)"


def command(module: str, *args: object) -> list[str]:
    """`python -m benchmarks.MODULE ARGS...` in this interpreter. Run it with cwd=ROOT: -m puts
    the working folder on sys.path, which is how an interpreter without doel installed (the
    emulated ones of check_arm64 and check_avx2) finds both packages."""
    return [sys.executable, "-m", f"benchmarks.{module}", *map(str, args)]


def parser(doc: str, work: str | None = None) -> argparse.ArgumentParser:
    """The command line of a benchmark: its docstring's first line, --out (the results folder)
    and, given its help, --work (a scratch folder)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    if work:
        ap.add_argument("--work", help=work)
    return ap


def machine(python: bool = False) -> str:
    """`x86_64, 2 cores` (and `, Python 3.11.2`): the machine line of a result."""
    text = f"{platform.machine()}, {os.cpu_count()} cores"
    return text + (f", Python {platform.python_version()}" if python else "")


def stamp(python: bool = False) -> dict:
    """The date, machine and CPU (cpu_class.this_cpu) a result starts with, and the machine's
    1-minute load then (other jobs share it)."""
    return {
        "date": date.today().isoformat(),
        "machine": machine(python),
        "cpu": this_cpu(),
        "load_start": os.getloadavg()[0],
    }


def cpu_name(cpu: dict) -> str:
    """`AMD EPYC 9R14 (Zen 4 (family 25, model 17)), class **amd-avx512-vnni**`: how a report
    names the CPU it ran on (results made before the core was recorded name the model alone)."""
    core = f" ({cpu['core']})" if cpu.get("core") else ""
    return f"{cpu.get('model_name', '?')}{core}, class **{cpu['class']}**"


def cpu_line(cpu: dict) -> str:
    """`CPU: <name>, class **<class>** (<ISA extensions>).`"""
    return f"CPU: {cpu_name(cpu)} ({isa_summary(cpu)})."


def heading(title: str, result: dict, with_machine: bool = True) -> list[str]:
    """A report's first lines: `# TITLE (DATE, MACHINE)` and a blank line."""
    where = f"{result['date']}, {result['machine']}" if with_machine else result["date"]
    return [f"# {title} ({where})", ""]


def load_line(at: str = "at the end") -> str:
    """The machine's load when a run ended, noted beside its figures (other jobs share it)."""
    return f"load average {os.getloadavg()[0]:.1f} {at}"


def render_again(path: str | Path, markdown, figure=None) -> Path:
    """A result's JSON at `path` written again, whole, beside its Markdown (`markdown(result)`)
    and, given `figure(result)`, its PNG: a report changed, nothing measured again."""
    path = Path(path)
    result = json.loads(path.read_text(encoding="utf-8"))
    fig = figure(result) if figure is not None else None
    return publish(path.parent, path.stem, result, markdown(result), fig, echo=False)


def publish(
    out: str | Path,
    name: str,
    result: dict,
    text: str,
    figure=None,
    echo: bool = True,
    beside: dict[str, str] | None = None,
) -> Path:
    """`name`.json and `name`.md in `out` (made if missing), `name`.png when given a matplotlib
    `figure` (closed after) and `name` + suffix for each text `beside` holds (a model card:
    `{"_card.md": text}`), each written whole and renamed into place; then the text printed
    unless `echo` is off. The Markdown's path."""
    out = Path(out)
    text_json = json.dumps(result, indent=2, ensure_ascii=False) + "\n"  # Bangla as written
    png = None
    if figure is not None:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")  # at the figure's own dpi
        png = buffer.getvalue()
        import matplotlib.pyplot as plt

        plt.close(figure)
    atomic_write_bytes(out / f"{name}.json", text_json.encode("utf-8"))
    atomic_write_bytes(out / f"{name}.md", text.encode("utf-8"))
    if png is not None:
        atomic_write_bytes(out / f"{name}.png", png)
    for suffix, other in (beside or {}).items():
        atomic_write_bytes(out / f"{name}{suffix}", other.encode("utf-8"))
    if echo:
        print(text)
    return out / f"{name}.md"
