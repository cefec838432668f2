"""The documentation is checked like code: the site builds with `mkdocs build --strict` (broken
links and missing pages fail), the command-line reference is rendered from the parsers and every
subcommand and flag explains itself, the recipe's cost table is the recipe's own arithmetic, and
the shell and Python blocks of the getting-started and serving pages (and the README's `openai`
example) run as printed. A block that cannot run here says why in the page source, in an HTML
comment on the line before it: `<!-- not run: REASON -->`."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from live_server import live_server

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent  # doel-train, doel-export... of this environment

FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:(.*?)-->\s*$", re.S)


def load_hook():
    spec = importlib.util.spec_from_file_location("docs_cli_hook", DOCS / "hooks" / "cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(path: Path) -> list[tuple[str, str, str | None]]:
    """(language, code, reason not run or None) for every fenced block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip()
        note = NOT_RUN.search(before[before.rfind("<!--") :]) if before.endswith("-->") else None
        out.append((m.group(1), m.group(2), note.group(1).strip() if note else None))
    return out


def runnable(path: Path) -> list[tuple[str, str]]:
    return [
        (lang, code) for lang, code, why in blocks(path) if lang in ("bash", "python") and not why
    ]


def run_block(lang: str, code: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DOEL_API_KEY", None)
    cmd = (
        ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    )
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# -- the site -------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_strict_with_every_page_and_the_cli_reference(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in DOCS.glob("*.md"):
        name = "" if page.stem == "index" else page.stem + "/"
        assert (site / name / "index.html").is_file(), f"{page.name} was not built"
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    for name, _ in load_hook().parsers():
        assert f"<code>{name}</code>" in cli, f"{name} is missing from the CLI reference"
    changelog = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    assert "Unreleased" in changelog  # CHANGELOG.md itself, included


def test_the_mkdocs_nav_names_every_page_and_only_pages_that_exist():
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = {p.name for p in DOCS.glob("*.md")} | {"cli.md"}  # cli.md: rendered at build time
    assert set(nav) == pages


# -- the command lines ------------------------------------------------------------------------


def undocumented(parsers) -> list[str]:
    """What a user's `--help` leaves unexplained: a subcommand without a description, a flag or
    positional argument without help."""
    missing = []
    for name, parser in parsers:
        if " " in name and not (parser.description or "").strip():
            missing.append(f"{name}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: no help")
    return missing


def test_every_subcommand_has_a_description_and_every_flag_a_help_text():
    parsers = load_hook().parsers()
    assert {name for name, _ in parsers} >= {
        "doel demo",
        "doel recipe",
        "doel-train tokenizer",
        "doel-train fit",
        "doel-export",
        "doel-serve",
    }
    assert undocumented(parsers) == []


def test_the_walk_finds_a_bare_flag_and_a_subcommand_without_a_description():
    top = argparse.ArgumentParser(prog="doel-x", description="d")
    sub = top.add_subparsers().add_parser("go", help="h")
    sub.add_argument("--quiet", action="store_true")
    sub.add_argument("--out", help="where")
    assert undocumented([("doel-x", top), ("doel-x go", sub)]) == [
        "doel-x go: no description",
        "doel-x go --quiet: no help",
    ]


def test_the_cli_reference_shows_every_flag_with_its_help():
    hook = load_hook()
    page = hook.render()
    for name, parser in hook.parsers():
        assert f"## `{name}`" in page
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:  # hidden from --help, so from the page too
                continue
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert f"`{action.option_strings[0]}`" in page, (name, action.option_strings)
                assert hook._cell(action.help) in page


# -- what the recipe costs ----------------------------------------------------------------------


def test_the_recipe_page_cost_table_is_the_recipes_own_arithmetic(tmp_path):
    torch = pytest.importorskip("torch")
    from doel.pipeline.budget import (
        GB,
        estimate_needs,
        hidden_matrix_count,
        parameter_count,
        projection,
    )
    from doel.pipeline.spec import load_recipe, make_plan, resolve_recipe
    from doel.train.metrics import GPU_PEAK_BF16
    from doel.train.model import Llama

    plan = make_plan(load_recipe(resolve_recipe("bangla-0.4b")), tmp_path, yes=True)
    cfg, recipe = plan.train_cfg, plan.recipe
    with torch.device("meta"):
        flops = Llama(cfg.model).flops_per_token(cfg.seq_len)["total"]
    per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    page = (DOCS / "recipe.md").read_text(encoding="utf-8")
    assert f"{parameter_count(cfg.model):,} parameters" in page
    assert f"{flops:,} training FLOPs a token" in page
    assert f"{cfg.steps:,} steps of {per_step:,} tokens" in page
    assert f"${recipe.hourly_price:.2f} a GPU-hour" in page
    peak = GPU_PEAK_BF16["H100 SXM"]
    assert f"{peak / 1e12:.0f} TFLOP/s" in page
    for mfu in (0.3, 0.4, 0.5):
        p = projection(cfg.steps, 0, per_step * flops / (peak * mfu), 1, recipe.hourly_price)
        assert f"{p['total_s'] / 3600:.2f} h, ${p['total_usd']:.2f}" in page, mfu
    quants = {q: q in recipe.export.mobile for q in recipe.export.quants}
    needs = estimate_needs(
        dict(recipe.corpus_chars),
        {s.name: s.language for s in recipe.sources},
        recipe.data.chars_per_token,
        recipe.tokenizer.vocab_size,
        parameter_count(cfg.model),
        cfg.keep_checkpoints,
        quants,
        recipe.tokenizer.max_chars,
        recipe.prepare.overlap_sample,
        recipe.data.chunk_chars,
        muon_params=hidden_matrix_count(cfg.model) if cfg.optimizer == "muon" else 0,
    )
    needs["sft"] = needs["train"]  # as the runner counts the chat fine-tuning's checkpoints
    assert f"{needs['data'].disk / GB:.2f} GB on disk" in page
    assert f"| {sum(n.disk for n in needs.values()) / GB:.1f} GB |" in page
    assert f"| {max(n.ram for n in needs.values()) / GB:.2f} GB |" in page
    chars = sum(recipe.corpus_chars.values())
    assert f"{chars / 1e9:.1f} billion characters" in page
    assert math.isclose(chars, recipe.token_budget * recipe.data.chars_per_token, rel_tol=0.01)


# -- pages that run -----------------------------------------------------------------------------


def test_a_block_not_run_says_why_and_each_runnable_page_runs_something():
    for page in ("getting-started.md", "serving.md"):
        found = blocks(DOCS / page)
        assert all(why for _, _, why in found if why is not None), page
        assert runnable(DOCS / page), f"{page} has no block that runs"
    # the marker is read from the line before a block, not from anywhere earlier
    sample = "<!-- not run: x -->\n```bash\na\n```\n\ntext\n\n```bash\nb\n```\n"
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write(sample)
    try:
        assert [why for _, _, why in blocks(Path(f.name))] == ["x", None]
    finally:
        os.unlink(f.name)


@pytest.mark.slow
def test_the_getting_started_page_runs_as_printed(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "sample").symlink_to(ROOT / "train" / "sample")
    for lang, code in runnable(DOCS / "getting-started.md"):
        proc = run_block(lang, code, tmp_path)
        assert proc.returncode == 0, f"{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "bundle" / "manifest.json").is_file()


def _pointed_at(code: str, url: str) -> str:
    host = url.removeprefix("http://")
    return code.replace("localhost:8000", host).replace("127.0.0.1:8000", host)


@pytest.mark.slow
def test_the_serving_pages_examples_run_against_a_live_server(tiny_bundle, tmp_path):
    examples = runnable(DOCS / "serving.md")
    with live_server(tiny_bundle, tmp_path, "--model-name", "bundle") as server:
        for lang, code in examples:
            proc = run_block(lang, _pointed_at(code, server.url), tmp_path, timeout=120)
            assert proc.returncode == 0, f"{code}\n{proc.stderr[-3000:]}"
            assert proc.stdout.strip(), code
            if "prints the error" in code:
                assert '"error":' in proc.stdout, code
            else:
                assert '"error":' not in proc.stdout, f"{code}\n{proc.stdout[-2000:]}"


@pytest.mark.slow
def test_the_readmes_openai_example_runs_against_the_demos_server(tiny_bundle, tmp_path):
    """The README's `openai` block, as printed, against a server like the demo's: the chat bundle
    served under its folder's name, bundle-chat-int4, on the port the README says."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (code,) = [
        c for lang, c, _ in blocks(ROOT / "README.md") if lang == "python" and "OpenAI(" in c
    ]
    assert 'model="bundle-chat-int4"' in code
    assert "--port 8000" in readme and "127.0.0.1:8000" in code
    with live_server(tiny_bundle, tmp_path, "--model-name", "bundle-chat-int4") as server:
        proc = run_block("python", _pointed_at(code, server.url), tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- the front page -------------------------------------------------------------------------------


def test_the_readme_is_a_short_front_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", readme)
    assert "CHANGELOG.md" in links and "docs/recipe.md" in links
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert any(link.startswith("benchmarks/results/") for link in links)
