"""benchmarks/ as a package: no sys.path edits, every module runs as
`python -m benchmarks.STAGE.NAME`, every result goes through the one writer, and every committed
result is claimed by a module."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- benchmarks/ as a package


def sys_path_edits(source: str) -> list[int]:
    """Lines where a source changes sys.path: a call of one of its methods (insert, append,
    extend, ...), an assignment to it or to an item of it, or `+=` on it."""

    def is_sys_path(node) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value):
                lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_sys_path_check_finds_every_kind_of_edit():
    source = (
        "import sys\n"
        "sys.path.insert(0, 'x')\n"
        "sys.path.append('x')\n"
        "sys.path[:0] = ['x']\n"
        "sys.path += ['x']\n"
        "sys.path = ['x']\n"
        "print(sys.path, 'sys.path.insert')\n"  # reading it, or naming it in text, is no edit
    )
    assert sys_path_edits(source) == [2, 3, 4, 5, 6]


def test_no_file_of_benchmarks_or_tests_edits_sys_path():
    """Benchmarks import each other as `benchmarks.STAGE.NAME` and run as
    `python -m benchmarks.STAGE.NAME` from the root; llama.cpp's vendored gguf package is loaded
    by its path (bench_serve_llama.gguf_package). No exception."""
    files = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tests").rglob("*.py")])
    assert len(files) > 40
    edits = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in files
        for line in sys_path_edits(p.read_text(encoding="utf-8"))
    ]
    assert edits == []


def load_hook():
    spec = importlib.util.spec_from_file_location(
        "docs_benchmarks_hook", ROOT / "docs" / "hooks" / "benchmarks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Modules of benchmarks/ that write no results file, and why.
NOT_RESULTS = {
    "common.report": "the one writer itself",
    "common.cpu_class": "prints this CPU's class",
    "serve.bench_serve_engines": "one engine's figures, a file for bench_serve's own process",
    "serve.bench_serve_llama": "builds llama-cpp-python and GGUF files",
    "serve.bench_serve_report": "bench_serve's Markdown and PNG",
    "serve.bench_spec_report": "bench_spec's Markdown and PNG",
    "load.bench_load_inproc": "one in-process engine's levels, a file for bench_load's process",
    "load.bench_load_report": "bench_load's targets, Markdown and PNG",
    "export.bench_real_model_report": "bench_real_model's Markdown",
    "load.load_client": "bench_load's HTTP client",
    "load.load_model": "bench_load's model files and prompts",
    "load.load_servers": "builds llama-server; starts bench_load's servers",
    "web.bench_web_report": "bench_web's Markdown and its verdicts",
    "probes.probe_web_table": "probe_web_matmul's Markdown",
    "web.web_loss": "bench_web's held-out loss of the page's graphs and kernel",
    "web.web_kernel_node": "runs the page's kernel in Node.js for web_loss",
    "probes.probe_stream": "the streaming-read bandwidth that bench_serve and the probes record",
    "probes.probe_chain": "probe_ablation's per-shape MatMulNBits timing",
    "probes.probe_ablation_report": "probe_ablation's Markdown",
}

# Files a module writes that are not results (scratch for a child process, a cache, a model),
# by module: one line each on what they are. Every other file write in benchmarks/ is the
# writer's (common.report.publish).
SCRATCH = {
    "load.bench_load": "the in-process run's spec, for its child process",
    "load.load_servers": "a server's log, in the scratch folder",
    "probes.probe_accuracy_level": "a bundle's files copied beside a graph of another level",
    "load.bench_load_inproc": "onnxruntime-genai's config beside links to a bundle; its levels",
    "web.web_kernel_node": "the Node.js script and its windows, in a temporary folder",
    "web.web_loss": "a page graph's weights copied into a scratch folder",
    "web.bench_web": "the engine run's spec, for its child process",
    "serve.bench_serve_engines": "one engine's figures, for bench_serve's process",
    "serve.bench_serve_llama": "a padded tokenizer.json beside the checkpoint it converts",
    "serve.bench_bangla_chars": "the engine runs' spec, for their child processes",
    "serve.bench_chat": "spec and rows passed between its processes",
    "serve.bench_serve": "the engine runs' spec, for their child processes",
    "checks.check_arm64": "apt's sources list, the worker's job and its result (scratch)",
    "checks.check_seed_isolation": "the server's API keys file",
    "runtimes.page_numerics": "a bundle copied with its embedding's scales nudged (scratch)",
    "probes.probe_web_matmul": "the probe's weights, Node.js script, worker and page (scratch)",
    "export.bench_gguf": "held-out text copied for llama.cpp",
    "probes.probe_ablation": "the ablated copies of a bundle's graph, beside its weights",
    "probes.probe_stream": "its C read kernel's source and library, in ~/.cache/doel",
    "export.bench_phone_memory": "/proc/self/clear_refs, to reset the peak resident memory",
    "export.bench_export": "the exports' figures, kept between runs in --work",
    "export.bench_real_model": "the speed rows' spec for their processes; the figures, in --work",
    "train.bench_train": "the run's metrics log and its child's stdout, in --work",
    "train.gpu_first_hour": "each part's log and traceback, in its --work",
    "train.bench_optim": "a run's figures cached in --work",
    "train.bench_adapt": "its text, each run's figures and the runtime checks, in --work",
}


def row_module(name: str) -> bool:
    """A module of benchmarks/runtimes/ but its aggregator: it returns rows to bench_runtimes
    (which publishes them) and writes only the models and files it checks, in its work folder."""
    return name.startswith("runtimes.") and name != "runtimes.bench_runtimes"


WRITES = {"write_text", "write_bytes", "savefig", "dump", "atomic_write_bytes", "copyfile"}


def writes(tree: ast.AST) -> list[int]:
    """Lines that write a file: write_text/write_bytes, savefig, json.dump, a copy, an atomic
    write, or open() in a mode that writes."""
    lines = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        name = _name(call.func)
        mode = [a.value for a in call.args[1:2] if isinstance(a, ast.Constant)]
        mode += [
            k.value.value
            for k in call.keywords
            if k.arg == "mode" and isinstance(k.value, ast.Constant)
        ]
        if name in WRITES or (name == "open" and any(set("wax") & set(str(m)) for m in mode)):
            lines.append(call.lineno)
    return sorted(lines)


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _trees() -> dict[str, ast.AST]:
    return {
        name: ast.parse(path.read_text(encoding="utf-8"))
        for name, path in load_hook().modules().items()
    }


def test_the_write_scan_finds_every_kind_of_write():
    source = (
        "import json\n"
        "p.write_text(json.dumps(r, indent=2))\n"
        "json.dump(r, f)\n"
        "fig.savefig(path)\n"
        "open(path, 'w')\n"
        "open(path, mode='ab')\n"
        "open(path).read()\n"  # reading is no write
        "shutil.copyfile(a, b)\n"
    )
    assert writes(ast.parse(source)) == [2, 3, 4, 5, 6, 8]


def test_every_benchmark_writes_its_results_through_the_one_writer():
    """A result is written whole by common.report.publish (JSON, Markdown, PNG: a stopped run
    leaves the last one): every module that is not a helper calls it, and no other module
    writes a file save those SCRATCH names, none of them a report (indented JSON, a
    markdown(...) text or a figure)."""
    trees = _trees()
    assert set(NOT_RESULTS) | set(SCRATCH) <= set(trees), "a module named here is gone"
    missing = [
        name
        for name, tree in sorted(trees.items())
        if name not in NOT_RESULTS
        and not row_module(name)
        and "publish" not in {_name(c.func) for c in ast.walk(tree) if isinstance(c, ast.Call)}
    ]
    assert missing == []
    outside = [
        f"{name}:{line}"
        for name, tree in sorted(trees.items())
        if name != "common.report" and name not in SCRATCH and not row_module(name)
        for line in writes(tree)
    ]
    assert outside == []
    by_hand = []
    for name, tree in sorted(trees.items()):
        if name == "common.report":
            continue
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if _name(call.func) == "savefig":
                by_hand.append(f"{name}:{call.lineno}")
            if _name(call.func) != "write_text" or not call.args:
                continue
            arg = call.args[0]
            report_json = isinstance(arg, ast.Call) and _name(arg.func) == "dumps"
            report_json = report_json and any(k.arg == "indent" for k in arg.keywords)
            if report_json or (isinstance(arg, ast.Call) and "markdown" in _name(arg.func)):
                by_hand.append(f"{name}:{call.lineno}")
    assert by_hand == []


def test_every_committed_result_is_claimed_by_the_module_that_writes_it():
    """benchmarks/results/ against the modules' RESULTS (what docs/benchmarks.md and the
    architecture page's tree are rendered from): every committed file is some module's, every
    RESULTS entry has a committed file, every RESULTS_NOT_YET_RUN entry none, and a module that
    writes results says which."""
    hook = load_hook()
    stems = hook.committed()
    claims = {
        name: hook.constants(path)
        for name, path in hook.modules().items()
        if name not in NOT_RESULTS and not row_module(name)
    }
    assert [n for n, c in claims.items() if not (c["RESULTS"] or c["RESULTS_NOT_YET_RUN"])] == []
    patterns = [hook.pattern(r) for c in claims.values() for r in c["RESULTS"]]
    assert [s for s in stems if not any(p.match(s) for p in patterns)] == []
    unmatched = [
        f"{n}: {r}"
        for n, c in claims.items()
        for r in c["RESULTS"]
        if not any(hook.pattern(r).match(s) for s in stems)
    ]
    assert unmatched == []
    ran = [
        f"{n}: {r}"
        for n, c in claims.items()
        for r in c["RESULTS_NOT_YET_RUN"]
        if any(hook.pattern(r).match(s) for s in stems)
    ]
    assert ran == []
    assert hook.pattern("serve_0.4b_cpu-<class>").match("serve_0.4b_cpu-amd-avx512-vnni")
    assert not hook.pattern("serve_0.4b_cpu-<class>").match("serve_load_0.4b_cpu-amd-avx2")


def test_the_benchmarks_page_lists_every_module_that_writes_results():
    hook = load_hook()
    table = hook.table()
    for name, path in hook.modules().items():
        c = hook.constants(path)
        if c["RESULTS"] or c["RESULTS_NOT_YET_RUN"]:
            assert f"| `{name}` | {hook._cell(hook.summary(c['doc']))} |" in table, name
        else:
            assert f"`{name}`" in table.rsplit("Helpers", 1)[1], name
    assert "`make bench-serve`" in table and "`serve_0.4b_cpu-amd-avx2`" in table
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert hook.TABLE in page
    arch = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert hook.RESULTS_LIST in arch


@pytest.mark.slow  # a fresh interpreter per module
def test_every_benchmark_runs_as_a_module_of_the_package():
    """`python -m benchmarks.STAGE.NAME --help` from the root, for every module with a command
    line: what the Makefile, the docstrings and the modules' own subprocesses run."""
    names = sorted(
        name
        for name, p in load_hook().modules().items()
        if "parse_args(" in p.read_text(encoding="utf-8") and name != "common.report"
    )
    assert {"serve.bench_serve", "checks.check_arm64", "train.bench_train"} <= set(names)
    assert "serve.profile_serve" in names
    env = {**os.environ, "PYTHONPATH": ""}

    def help_of(name: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", f"benchmarks.{name}", "--help"]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    # one interpreter a core at a time: each spends its second or two importing, not waiting
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name, proc in zip(names, pool.map(help_of, names)):
            assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
            assert "usage:" in proc.stdout, name
