"""MkDocs hook: the table of every benchmark in docs/benchmarks.md and the results list of
docs/architecture.md's tree, rendered at build time from the modules themselves, so neither can
drift from what benchmarks/ holds. Each module is read, never imported (no torch, no
onnxruntime at build time): its docstring's first sentence says what it compares, its
`RESULTS` names the result files it writes (`<class>` a CPU class, `<x>` any other part of a
name) and `RESULTS_NOT_YET_RUN` those no committed file holds yet.
tests/benchmarks/test_package.py holds both lists to benchmarks/results/."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TABLE = "<!-- every benchmark: rendered from the modules when the site is built -->"
RESULTS_LIST = "<results: rendered from the modules when the site is built>"
STAGES = ("train", "export", "serve", "load", "web", "runtimes", "checks", "probes")


def modules() -> dict[str, Path]:
    """`stage.name` -> path of every module under benchmarks/ but the packages' __init__."""
    return {
        f"{p.parent.name}.{p.stem}": p
        for p in sorted(BENCHMARKS.glob("*/*.py"))
        if p.stem != "__init__" and p.parent.name != "results"
    }


@functools.cache
def constants(path: Path) -> dict:
    """The module's docstring and its RESULTS / RESULTS_NOT_YET_RUN tuples, read from its
    source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {"doc": ast.get_docstring(tree) or "", "RESULTS": (), "RESULTS_NOT_YET_RUN": ()}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", "")
            if name in ("RESULTS", "RESULTS_NOT_YET_RUN") and not isinstance(node.value, ast.Call):
                found[name] = tuple(ast.literal_eval(node.value))
    return found


def summary(doc: str) -> str:
    """The docstring's first sentence, on one line."""
    text = " ".join(doc.split())
    m = re.match(r"(.+?[.?!])(\s|$)", text)
    return (m.group(1) if m else text).removesuffix(".")


def pattern(name: str) -> re.Pattern:
    """A RESULTS entry as a regex over file stems: `<class>` a CPU class slug, `<x>` any name."""
    parts = re.split(r"(<[a-z ]+>)", name)
    rx = "".join(
        r"[a-z0-9]+(?:-[a-z0-9]+)*"
        if p == "<class>"
        else r"[A-Za-z0-9._-]*"
        if p.startswith("<")
        else re.escape(p)
        for p in parts
    )
    return re.compile(rx + "$")


def committed() -> dict[str, list[str]]:
    """stem -> its committed files' suffixes (`.json`, `.md`, `.png`) in benchmarks/results/."""
    out: dict[str, list[str]] = {}
    for p in sorted((BENCHMARKS / "results").iterdir()):
        if p.suffix in (".json", ".md", ".png"):
            out.setdefault(p.stem, []).append(p.suffix)
    return out


def make_targets() -> dict[str, str]:
    """`stage.name` -> the Makefile target whose recipe runs it."""
    targets, current = {}, None
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([\w-]+):", line)
        if m:
            current = m.group(1)
        recipe = current and line.startswith("\t")
        for module in re.findall(r"-m benchmarks\.([\w.]+)", line) if recipe else ():
            targets.setdefault(module, current)
    return targets


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    """The Markdown table: one row a module that writes results, stage by stage."""
    stems, targets = committed(), make_targets()
    lines = ["| module | what it compares | rerun | results in `benchmarks/results/` |"]
    lines.append("|---|---|---|---|")
    for stage in STAGES:
        rows = []
        for module, path in modules().items():
            c = constants(path)
            if not module.startswith(f"{stage}.") or not (c["RESULTS"] or c["RESULTS_NOT_YET_RUN"]):
                continue
            runs = f"`python -m benchmarks.{module}`"
            runs = f"`make {targets[module]}`" if module in targets else runs
            claimed = [s for r in c["RESULTS"] for s in stems if pattern(r).match(s)]
            files = [f"`{s}`" for s in dict.fromkeys(claimed)]
            files += [f"`{r}` (not yet run)" for r in c["RESULTS_NOT_YET_RUN"]]
            what = _cell(summary(c["doc"]))
            rows.append(f"| `{module}` | {what} | {runs} | {', '.join(files)} |")
        lines += rows
    helpers = [
        f"`{m}`"
        for m, p in modules().items()
        if not (constants(p)["RESULTS"] or constants(p)["RESULTS_NOT_YET_RUN"])
    ]
    lines += ["", f"Helpers that write no result of their own: {', '.join(helpers)}.", ""]
    return "\n".join(lines)


def results_list(indent: str) -> str:
    """Every RESULTS entry, wrapped as comment lines of the architecture page's tree."""
    names = sorted({r for p in modules().values() for r in constants(p)["RESULTS"]})
    lines, line = [], ""
    for name in names:
        if line and len(line) + len(name) > 66:
            lines.append(line.rstrip(", ") + ",")
            line = ""
        line += f"{name}.*, "
    lines.append(line.rstrip(", ") + " (JSON, Markdown, PNG)")
    return f"\n{indent}# ".join(lines)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "benchmarks.md":
        return markdown.replace(TABLE, table())
    if page.file.src_uri == "architecture.md" and RESULTS_LIST in markdown:
        at = markdown.index(RESULTS_LIST)
        indent = " " * (at - markdown.rfind("\n", 0, at) - 3)
        return markdown.replace(RESULTS_LIST, results_list(indent))
    return markdown
