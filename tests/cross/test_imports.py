"""The import graph of doel's folders, read from the source (imports at module level and inside
functions alike): no circle anywhere, and the boundaries of the guide: no stage (train, export,
serve) imports another, with no exception; only the pipeline (recipe, demo) uses all three;
doel.contracts imports the standard library alone. The runtime side of serve's boundary (no
torch after answering a request) is test_no_torch.py; train's is the fresh-interpreter
test below."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("train", "export", "serve")
FOLDERS = {  # installed name -> folder in the checkout (the wheel maps each under doel/)
    **{f"doel.{s}": ROOT / s for s in (*STAGES, "pipeline")},
    "doel.contracts": ROOT / "doel" / "contracts",
}
# The names the checkout's folders would have if imported from the root: never used.
BARE = (*STAGES, "pipeline", "contracts")


def module_name(path: Path) -> str:
    for name, folder in FOLDERS.items():
        if path.is_relative_to(folder):
            parts = [*name.split("."), *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for f in FOLDERS.values() for p in sorted(f.rglob("*.py"))}


def imported(path: Path, name: str | None = None) -> list[tuple[str, int]]:
    """Every module an `import` or `from ... import` names in the file (module `name`), at any
    depth, as absolute dotted names (a `from a import b` also names a.b, in case b is a
    module)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        for target, _ in imported(path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m:
                edges[m].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def offenders(prefix: str, banned: tuple[str, ...]) -> list[str]:
    """`file:line module` for each import under `prefix` of a module in `banned` (a dotted
    prefix: `doel.export` bans doel.export and everything under it)."""
    out = []
    for m, path in modules().items():
        if not (m == prefix or m.startswith(prefix + ".")):
            continue
        for target, line in imported(path):
            if any(target == b or target.startswith(b + ".") for b in banned):
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                out.append(f"{shown}:{line} {target}")
    return sorted(set(out))


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text("def f():\n    from doel.train.loop import StepLoop\n    from . import fit\n")
    names = {target for target, _ in imported(src, "doel.train.probe")}
    assert {"doel.train.loop", "doel.train.loop.StepLoop", "doel.train.fit"} <= names


def test_modules_are_named_as_installed():
    mods = modules()
    assert mods["doel.train.fit"] == ROOT / "train" / "fit.py"
    assert mods["doel.pipeline.demo"] == ROOT / "pipeline" / "demo.py"
    assert mods["doel.contracts"] == ROOT / "doel" / "contracts" / "__init__.py"


def test_no_import_circle_anywhere_in_doel():
    edges = graph()
    assert len(edges) > 60
    assert "doel.train.fit" in edges["doel.train.cli"] | set().union(*edges.values())
    assert cycles(edges) == []


def test_cycle_finder_finds_a_planted_circle():
    edges = graph()
    edges["doel.train.model"] = edges["doel.train.model"] | {"doel.train.fit"}  # fit reaches model
    assert any("doel.train.model" in c and "doel.train.fit" in c for c in cycles(edges))


@pytest.mark.parametrize("stage", STAGES)
def test_no_stage_imports_another_or_the_pipeline(stage):
    others = tuple(f"doel.{s}" for s in (*STAGES, "pipeline") if s != stage)
    assert offenders(f"doel.{stage}", others) == []


def test_the_stage_check_finds_a_planted_import(tmp_path, monkeypatch):
    planted = tmp_path / "train"
    planted.mkdir()
    (planted / "probe.py").write_text("def f():\n    from doel.export.bundle import x\n")
    monkeypatch.setitem(FOLDERS, "doel.train", planted)
    assert offenders("doel.train", ("doel.export",)) == [
        "probe.py:2 doel.export.bundle",
        "probe.py:2 doel.export.bundle.x",
    ]


def test_serve_imports_no_torch_or_the_export_toolchain():
    banned = ("torch", "transformers", "onnxruntime_genai", "optimum")
    assert offenders("doel.serve", banned) == []


def test_contracts_import_the_standard_library_alone():
    allowed = set(sys.stdlib_module_names) | {"doel.contracts", "__future__"}
    used = {
        t for m, p in modules().items() if m.startswith("doel.contracts") for t, _ in imported(p)
    }
    assert used, "doel.contracts imports nothing at all: the check would pass vacuously"
    outside = {
        t for t in used if t.split(".")[0] not in allowed and not t.startswith("doel.contracts")
    }
    assert outside == set()


def test_no_file_imports_a_folder_by_its_bare_name():
    """`import train` would load the checkout's folder a second time, under another name."""
    files = [
        p for top in (*BARE[:4], "doel", "tests", "benchmarks") for p in (ROOT / top).rglob("*.py")
    ]
    bad = [
        f"{p.relative_to(ROOT)}:{line} {t}"
        for p in files
        for t, line in imported(p, "tests.probe")
        if t.split(".")[0] in BARE
    ]
    assert bad == []


# Code run from a string (`python -c`, `-m`): the folders by their bare names. The two files
# below name them on purpose, to show a user's own `train` wins over doel's folder.
BARE_IN_CODE = re.compile(
    r"(?:^|[\n;]\s*)(?:from|import) (?:train|export|serve|pipeline)\b"
    r"|\"-m\", \"(?:train|export|serve)\""
)
ON_PURPOSE = {
    "tests/cross/test_packaging.py",
    "tests/pipeline/test_recipe.py",
    "tests/cross/test_imports.py",
}


def bare_names_in_code_strings(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    found = [
        f"{path.name}:{n.lineno}"
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and BARE_IN_CODE.search(n.value)
    ]
    return found + [
        f"{path.name}:argv" for m in BARE_IN_CODE.finditer(text) if m.group(0)[0] == '"'
    ]


def test_no_code_string_runs_a_folder_by_its_bare_name(tmp_path):
    files = [
        p
        for top in (*BARE[:4], "doel", "tests", "benchmarks")
        for p in (ROOT / top).rglob("*.py")
        if p.relative_to(ROOT).as_posix() not in ON_PURPOSE
    ]
    assert [hit for p in files for hit in bare_names_in_code_strings(p)] == []
    planted = tmp_path / "probe.py"
    planted.write_text(
        'CODE = "import sys; from train.cli import main"\nCMD = ["python", "-m", "serve"]\n'
    )
    assert bare_names_in_code_strings(planted) == ["probe.py:1", "probe.py:argv"]


def imports_of_test_modules(folder: Path) -> list[str]:
    """`file:line module` for each import of a test module (test_*.py) by another file under
    `folder`, however it is spelled: `from test_x import`, `from tests.test_x import`, relative."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for target, line in imported(path, f"tests.{path.stem}"):
            parts = target.split(".")
            module = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
            if module.startswith("test_"):
                out.append(f"{path.relative_to(folder)}:{line} {target}")
    return sorted(set(out))


def test_no_test_module_imports_another():
    """What tests share lives in conftest.py (session fixtures) or a helper module (not test_*):
    importing a test module collects its tests' helpers twice and ties one module's fixtures to
    another's."""
    assert imports_of_test_modules(ROOT / "tests") == []


def test_an_import_of_a_test_module_is_found_however_spelled(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "from test_serve_engine import tiny_bundle\n"
        "import tests.test_fit\n"
        "def f():\n    from . import test_verify\n"
        "from live_server import live_server\n"  # a helper module: allowed
    )
    assert imports_of_test_modules(tmp_path) == [
        "test_probe.py:1 test_serve_engine",
        "test_probe.py:1 test_serve_engine.tiny_bundle",
        "test_probe.py:2 tests.test_fit",
        "test_probe.py:4 tests.test_verify",
    ]


TRAIN_SCRIPT = """
import importlib, json, pkgutil, sys
import doel.train
names = [m.name for m in pkgutil.walk_packages(doel.train.__path__, "doel.train.")]
for name in names:
    if name != "doel.train.__main__":
        importlib.import_module(name)
banned = ("doel.export", "doel.serve", "doel.pipeline", "onnx", "onnxruntime", "fastapi",
          "uvicorn", "train", "export", "serve", "pipeline")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in banned
                        or ".".join(m.split(".")[:2]) in banned)))
"""


@pytest.mark.slow
def test_importing_all_of_train_loads_no_other_stage_and_no_bare_name():
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_architecture_file_tree_names_every_module_and_only_modules_that_exist():
    """The architecture page's file tree (docs/architecture.md, ## Files) is the map a newcomer
    walks: every module of train/, export/, serve/, pipeline/, doel/ and benchmarks/ is on it,
    at its folder, and nothing on it is gone."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = page.split("## Files", 1)[1].split("```")[1]
    listed, folders = set(), []
    for line in tree.splitlines():
        entry = line.split("#", 1)[0].rstrip()
        if not entry.strip():
            continue
        depth = (len(entry) - len(entry.lstrip())) // 2
        name = entry.strip()
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            listed.add("/".join([*folders, name]))
    code = {
        p.relative_to(ROOT).as_posix()
        for top in ("train", "export", "serve", "pipeline", "doel", "benchmarks")
        for p in (ROOT / top).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and "results" not in p.parts
    }
    listed_code = {
        p
        for p in listed
        if p.split("/")[0] in ("train", "export", "serve", "pipeline", "doel", "benchmarks")
    }
    assert code - listed_code == set(), "modules missing from docs/architecture.md's file tree"
    assert listed_code - code == set(), "docs/architecture.md's tree names modules that are gone"
