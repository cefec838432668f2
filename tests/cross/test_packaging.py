"""What `pip install doel` puts on a machine: one top-level package, `doel`, whose stages have
the same names installed, installed editable and under pytest from the root; and a serving
machine with only `doel[serve]` (no torch anywhere) that serves a bundle.

The wheel is built once per session with hatchling, without build isolation (no download);
the serve-only environment links the serve extra's installed distributions, and nothing else,
into a fresh venv, so it needs no network either.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("hatchling", reason="the dev extra builds the wheel with hatchling")
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*cmd, "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("doel-*.whl")
    return path


def wheel_names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return z.namelist()


@pytest.mark.slow
def test_the_wheel_holds_nothing_top_level_but_doel(wheel):
    names = wheel_names(wheel)
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"doel"}
    for module in ("train", "export", "serve", "pipeline", "contracts"):
        assert f"doel/{module}/__init__.py" in names
    # the package data the stages read: presets, the recipe, the sample, the pages
    for data in (
        "doel/train/configs/tiny.toml",
        "doel/train/sample/bn.txt",
        "doel/pipeline/recipes/bangla-0.4b/recipe.toml",
        "doel/serve/playground.html",
        "doel/serve/fonts/noto-sans-bengali.woff2",
        "doel/export/web/index.html",
    ):
        assert data in names
    with zipfile.ZipFile(wheel) as z:
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = dict(re.findall(r"^(\S+) = (\S+)$", z.read(entry).decode(), flags=re.M))
    assert scripts == {
        "doel": "doel.pipeline.cli:main",
        "doel-train": "doel.train.cli:main",
        "doel-export": "doel.export.cli:main",
        "doel-serve": "doel.serve.cli:main",
    }


def test_the_check_sees_a_stray_top_level_package(tmp_path):
    """The wheel test's reading of a file list: a top-level `train/` is caught."""
    stray = tmp_path / "stray.whl"
    with zipfile.ZipFile(stray, "w") as z:
        z.writestr("doel/__init__.py", "")
        z.writestr("train/__init__.py", "")
    assert {n.split("/")[0] for n in wheel_names(stray)} == {"doel", "train"}


DECOY = "raise SystemExit('the user\\'s own {name} was imported instead of doel\\'s')\n"
INSTALLED = """
import json, sys
import doel, doel.train.config as config, doel.pipeline.spec as spec, doel.serve.endpoints.protocol
import doel.contracts
print(json.dumps({
    "doel": doel.__file__,
    "path": list(doel.__path__),
    "presets": sorted(config.presets()),
    "recipes": [str(d) for d in spec.RECIPE_DIRS if d.is_dir()],
    "bare": sorted(m for m in sys.modules if m.split(".")[0] in
                   ("train", "export", "serve", "pipeline", "contracts")),
}))
"""


@pytest.mark.slow
def test_the_installed_wheel_finds_its_data_and_ignores_a_users_train_package(wheel, tmp_path):
    """Installed (the wheel unpacked into a site folder), doel reads its presets and recipes from
    inside the package, and a user's own `train`, `serve` and `export` packages, first on the
    path, neither shadow doel's nor are shadowed by it."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    user = tmp_path / "project"
    for name in ("train", "serve", "export", "pipeline"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(DECOY.format(name=name), encoding="utf-8")
    # the site folder before this venv's own (which holds the editable install's checkout)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), str(site)])}
    proc = subprocess.run(
        [sys.executable, "-c", INSTALLED],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["doel"]).parent == site / "doel"
    assert got["path"] == [str(site / "doel")]  # a wheel's doel never searches site-packages
    assert {"tiny", "small", "demo", "bangla-0.4b"} <= set(got["presets"])
    assert got["recipes"] == [str(site / "doel" / "pipeline" / "recipes")]
    assert got["bare"] == []
    # and the user's own package is still theirs
    mine = subprocess.run(
        [sys.executable, "-c", "import train"], cwd=user, env=env, capture_output=True, text=True
    )
    assert "the user's own train was imported" in mine.stderr


@pytest.mark.slow
def test_in_the_checkout_each_module_has_one_name():
    """pytest from the root (the root on sys.path) and the editable install: doel.train is the
    checkout's train/ folder, and importing doel's modules loads no bare `train`."""
    code = (
        "import sys, doel.train.fit, doel.pipeline.demo, doel.export.bundle, doel.serve.edge.app\n"
        "print(doel.train.fit.__file__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('train', 'export', 'serve', 'pipeline', 'contracts')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, bare = proc.stdout.strip().splitlines()[-2:]
    assert Path(path) == ROOT / "train" / "fit.py"
    assert bare == "[]"


# --- a machine with only doel[serve] ------------------------------------------------------------


def closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """The installed distributions `requirements` need, recursively (markers evaluated here)."""
    seen: set[str] = set()
    todo = [(r, extras) for r in requirements]
    while todo:
        text, active = todo.pop()
        req = Requirement(text)
        envs = [{"extra": e} for e in active] or [{"extra": ""}]
        if req.marker and not any(req.marker.evaluate(env) for env in envs):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        todo += [(r, tuple(req.extras)) for r in metadata.requires(req.name) or []]
    return seen


def serve_requirements() -> list[str]:
    """doel's own requirements that `pip install doel[serve]` would take on this Python."""
    reqs = [Requirement(r) for r in metadata.requires("doel") or []]
    picked = [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": "serve"})]
    return [r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") for r in picked]


def link_distributions(names: set[str], site: Path) -> None:
    """Each distribution's installed top-level entries (packages, modules, .libs, dist-info)
    linked into `site`: the files pip put there, without pip."""
    for name in names:
        dist = metadata.distribution(name)
        root = Path(dist.locate_file("")).resolve()
        for f in dist.files or []:
            top = Path(f).parts[0]
            if top == ".." or (site / top).exists():
                continue
            if (root / top).exists():
                (site / top).symlink_to(root / top)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_serve_only_machine_has_no_torch_and_serves_a_bundle(wheel, tiny_bundle, tmp_path):
    env_dir = tmp_path / "serve-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    needed = closure(serve_requirements())
    assert "onnxruntime" in needed and "fastapi" in needed and "torch" not in needed
    link_distributions(needed, site)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DOEL_API_KEY")}
    check = subprocess.run(
        [python, "-c", "import doel.serve.edge.app, doel.serve.cli; import torch"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "No module named 'torch'" in check.stderr, check.stderr[-3000:]
    port = free_port()
    cmd = [python, "-m", "doel.serve", str(tiny_bundle), "--port", str(port), "--threads", "1"]
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=err, text=True)
    try:
        body = json.dumps({"prompt": "নদী", "max_tokens": 3}).encode()
        deadline = time.monotonic() + 60
        while True:
            try:
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=30) as r:
                    answer = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the server did not answer in 60 s"
                time.sleep(0.2)
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_importing_the_export_bundle_loads_no_torch_or_runtime():
    """What pyproject.toml's PLC0415 exceptions for export/ buy: the heavy packages load where a
    path needs them."""
    code = (
        "import sys, doel.export.bundle, doel.export.cli\n"
        "heavy = ('torch', 'transformers', 'optimum', 'onnxruntime', 'onnxruntime_genai')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
