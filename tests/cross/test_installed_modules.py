"""The modules doel runs with `python -m` answer to their installed names (`doel.serve`,
`doel.export.web`...) from any folder, and every page and docstring that tells a user to run one
names it so: a bare `python -m serve` runs only from a checkout's root, or runs a user's own
`serve` package instead (tests/cross/test_packaging.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("train", "export", "serve", "pipeline")
# `python -m serve`, `-m export.web`, `prog="python -m export.web"`: a stage by its bare name
BARE = re.compile(r"-m\s+(" + "|".join(STAGES) + r")\b(?![-/])")


def told_to_the_user() -> list[Path]:
    """The pages, the stages' source and the presets: where a user reads a command (the
    benchmarks run from a checkout only, and the changelog records what was)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in (*STAGES, "doel", "configs"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".toml"))
    return files


def test_no_page_or_docstring_names_a_stage_by_its_bare_module_name():
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in told_to_the_user()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if BARE.search(line)
    ]
    assert found == [], "name the installed module (python -m doel.NAME):\n" + "\n".join(found)


def test_the_check_sees_a_bare_name():
    assert BARE.search('prog="python -m export.web",')
    assert BARE.search("torchrun --nproc_per_node=8 -m train fit")
    assert not BARE.search("python -m doel.export.web_kernel")
    assert not BARE.search("python -m benchmarks.serve.bench_serve")


@pytest.mark.parametrize("module", ["doel.export.web_kernel", "doel.export.web"])
def test_a_module_runs_by_its_installed_name_outside_the_checkout(module, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=tmp_path,  # not the checkout's root: its folders are not on the path from here
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: python -m {module} ")
