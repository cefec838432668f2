"""ARM64 check: does a bundle compute the same tokens on a phone's CPU as on the x86 that made it?

Phones are ARM64, where ONNX Runtime runs other kernels (NEON, dot-product, i8mm, KleidiAI for
MatMulNBits). With no phone here, serve/'s engine runs the bundle's model.onnx and model.ort in
an aarch64 userland under qemu-user (Debian 13's qemu 10, a Debian 12 arm64 root made by
debootstrap, aarch64 wheels of this venv's onnxruntime, numpy and tokenizers from PyPI), once
per emulated CPU model (CPUS), and on this x86 machine. Compared, per model file:
- the prompts' token ids (tokenizers on ARM must give x86's ids),
- greedy ids over NEW_TOKENS tokens; a mismatch names the first diverging prompt and position,
  with x86's top-1 margin there (a near-tie flips on any rounding),
- over held-out windows of WINDOW positions: top-1 agreement (and, where it moved, how far
  below its own top-1 x86 put ARM's choice), max logit difference (absolute, and relative to
  the largest x86 logit) and the loss increase in nats/token.
BOUNDS were set from measurement. Emulated speed says nothing about a phone; only correctness
is checked. It takes minutes at the demo's size and hours at 0.4B (see
benchmarks/results/arm64_*.md), so CI runs only the comparison's unit tests
(tests/benchmarks/test_check_arm64.py).

The environment is built once and cached (DOEL_ARM64_CACHE, default ~/.cache/doel/arm64); after
that the check needs no network. Run: `make check-arm64` (make demo's model, exported with
--mobile), or `python -m benchmarks.checks.check_arm64 DIR [DIR ...] --name NAME`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import numpy as np

from doel.serve.core.engine import BundleError, Engine, read_bundle  # the worker's too, under qemu

RESULTS = ("arm64_<name>",)

ROOT = Path(__file__).resolve().parents[2]

CACHE = Path(os.environ.get("DOEL_ARM64_CACHE", Path.home() / ".cache" / "doel" / "arm64"))
SUITE, PYTHON = "bookworm", "python3.11"  # the arm64 userland: Debian 12's Python 3.11
QEMU_SUITE = "trixie"  # qemu-user 10.0 (see _qemu)
CPUS = ("cortex-a53", "cortex-a76", "max")  # plain NEON; + dotprod, fp16; + i8mm, bf16, SVE
FILES = ("model.onnx", "model.ort")
LIBATOMIC = "usr/lib/aarch64-linux-gnu/libatomic.so.1"
NEW_TOKENS, WINDOW = 32, 256
PROMPTS = (
    "বাংলা ভাষা",
    "আমাদের গ্রামের পাশে একটি নদী",
    "The river flows",
    "Once upon a time",
)
# Set from the demo bundles under the three CPU models (benchmarks/results/arm64_demo.md): ARM's
# kernels moved logits by at most 4.3e-3 of the largest, flipped the top-1 at 3 of 512 held-out
# positions (near-ties) and moved the loss by 2e-4 nats/token or less; the bounds leave ~5-10x.
BOUNDS = {"top1_agreement": 0.98, "max_rel_diff": 0.02, "loss_increase": 0.002}
# How an interpreter runs the worker below (run_side adds `--worker DIR`), from ROOT.
WORKER = ("-m", "benchmarks.checks.check_arm64")


class ArmError(Exception):
    """The check cannot run here; the message says what to install or fix."""


# ------------------------------------------------------------------ the cached aarch64 userland


def _run(cmd: list[str], what: str, **kw) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-8:])
        raise ArmError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _wheels(dest: Path, platforms: tuple[str, ...], pins: list[str], deps: bool = False) -> Path:
    """Unpacked wheels in `dest` (a folder to put on PYTHONPATH), downloaded once; with `deps`,
    their dependencies too (pip reads their markers as on this x86_64 machine)."""
    if dest.is_dir():
        return dest
    part = dest.with_name(dest.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-q"]
    cmd += [] if deps else ["--no-deps"]
    cmd += [f"--platform={p}" for p in platforms]
    cmd += ["--python-version", "311", "--implementation", "cp", "-d", str(part / "whl"), *pins]
    _run(cmd, "pip download " + " ".join(pins))
    for wheel in (part / "whl").glob("*.whl"):
        _run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(part)], f"unpacking {wheel}")
    shutil.rmtree(part / "whl")
    part.rename(dest)
    return dest


def _userland(dest: Path) -> Path:
    """A Debian arm64 root with Python, unpacked without running anything in it (debootstrap's
    second stage would need binfmt_misc, which this machine does not mount)."""
    if (dest / "usr/bin" / PYTHON).is_file() and (dest / LIBATOMIC).is_file():
        return dest
    if not shutil.which("debootstrap"):
        raise ArmError("debootstrap is missing: apt-get install debootstrap")
    part = dest.with_name(dest.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)  # one from before libatomic1 was in it
    cmd = ["debootstrap", "--foreign", "--arch=arm64", "--variant=minbase"]
    # libatomic1: pytorch-tokenizers' aarch64 wheel (ExecuTorch's tokenizer) links it
    _run(
        [*cmd, f"--include={PYTHON},libstdc++6,libgomp1,libatomic1", SUITE, str(part)],
        "debootstrap",
    )
    for deb in sorted((part / "var/cache/apt/archives").glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(part)], f"unpacking {deb.name}")
    part.rename(dest)
    return dest


def _qemu(dest: Path) -> Path:
    """qemu-aarch64 10.0 from Debian 13's qemu-user, unpacked (its binaries are static): Debian
    12's qemu 7.2 crashes onnxruntime's aarch64 wheels from 1.28 on at import, and an ORT-format
    model runs only in an onnxruntime at least as new as the one that converted it."""
    binary = dest / "usr/bin/qemu-aarch64"
    if binary.is_file():
        return binary
    if not shutil.which("apt-get"):
        raise ArmError("fetching qemu-user needs apt-get (Debian or Ubuntu)")
    part = dest.with_name(dest.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    (part / "lists/partial").mkdir(parents=True)
    (part / "sources.list").write_text(f"deb http://deb.debian.org/debian {QEMU_SUITE} main\n")
    opts = [f"-oDir::Etc::SourceList={part / 'sources.list'}", f"-oDir::Etc::SourceParts={part}/-"]
    opts += [f"-oDir::State::Lists={part / 'lists'}", "-oAPT::Sandbox::User=root"]
    _run(["apt-get", *opts, "update"], f"apt-get update ({QEMU_SUITE})")
    _run(["apt-get", *opts, "download", "qemu-user"], "apt-get download qemu-user", cwd=part)
    (deb,) = part.glob("qemu-user_*.deb")
    _run(["dpkg-deb", "-x", str(deb), str(part / "x")], "unpacking qemu-user")
    binary.parent.mkdir(parents=True)  # only the one emulator of its 40 (16 of 455 MB)
    (part / "x/usr/bin/qemu-aarch64").rename(binary)
    shutil.rmtree(part)
    return binary


def ensure_env(cache: Path = CACHE) -> dict:
    """Side name -> the command that runs the worker and its environment: x86_64 in this venv,
    aarch64 under qemu once per CPU model with the same onnxruntime, numpy and tokenizers. Built
    on first use (about 2 minutes, under 200 MB of downloads, 420 MB on disk), then reused
    offline."""
    pins = [f"{n}=={_version(n)}" for n in ("onnxruntime", "numpy", "tokenizers")]
    arm = ("manylinux_2_28_aarch64", "manylinux2014_aarch64")
    sides = {cpu: aarch64_python(pins, arm, cpu, cache) for cpu in CPUS}
    return {
        "x86_64": {"cmd": [sys.executable, *WORKER], "env": {}},
        **{
            f"aarch64 {cpu}": {"cmd": [*side["cmd"], *WORKER], "env": side["env"]}
            for cpu, side in sides.items()
        },
    }


def aarch64_python(
    pins: list[str], platforms: tuple[str, ...], cpu: str, cache=CACHE, with_deps=()
) -> dict:
    """{"cmd": [qemu, -L, root, python3.11], "env": {...}}: the cached Debian arm64 root's Python
    under qemu-user as CPU model `cpu`, with the wheels of `pins` (no dependencies) and of
    `with_deps` (and theirs), each for `platforms`, on its path. The phone runtimes' ARM64 rows
    run their probes on it (benchmarks/runtimes/executorch_arm64.py, litertlm_arm64.py)."""
    if platform.machine() != "x86_64":
        raise ArmError(f"this check emulates ARM64 on x86_64; this machine is {platform.machine()}")
    cache.mkdir(parents=True, exist_ok=True)
    qemu = _qemu(cache / f"qemu-{QEMU_SUITE}")
    root = _userland(cache / "root")
    sites = [_wheels(cache / _site(pins), platforms, pins)]
    if with_deps:
        sites.append(_wheels(cache / (_site(with_deps) + "-deps"), platforms, [*with_deps], True))
    cmd = [str(qemu), "-L", str(root), str(root / "usr/bin" / PYTHON)]
    return {"cmd": cmd, "env": {"PYTHONPATH": os.pathsep.join(map(str, sites)), "QEMU_CPU": cpu}}


def _site(pins) -> str:
    """A site folder's name: its pins ("site-litert-lm-api0.18.1"), hashed past a few."""
    import hashlib

    name = "site-" + "-".join(pins).replace("==", "")
    if len(name) <= 80:
        return name
    return f"site-{pins[0].replace('==', '')}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"


def qemu_version(side: dict) -> str:
    """qemu-user's version ("10.0.7") of a side `aarch64_python` made."""
    done = subprocess.run([side["cmd"][0], "--version"], capture_output=True, text=True)
    return done.stdout.split()[2] if done.stdout.count(" ") >= 2 else "?"


def _version(name: str) -> str:
    from importlib import metadata

    return metadata.version(name)


# ------------------------------------------------------------------ the worker (either machine)


def work(job: dict, out: Path) -> dict:
    """Run by the command each side's environment gives: tokenize, greedy-decode, score."""
    import onnxruntime
    from tokenizers import Tokenizer

    bundle = read_bundle(job["bundle"])
    tok = Tokenizer.from_file(str(bundle.tokenizer))
    result = {
        "machine": platform.machine(),
        "onnxruntime": onnxruntime.__version__,
        "prompt_ids": [tok.encode(p).ids for p in job["prompts"]],
        "models": {},
    }
    for name in job["models"]:
        t0 = time.perf_counter()
        engine = Engine(replace(bundle, model=bundle.folder / name), threads=1)
        greedy, margins = [], []
        for ids in job["prompt_ids"]:
            made, gaps = greedy_ids(engine, ids, job["new_tokens"])
            greedy.append(made)
            margins.append(gaps)
        logits = [engine.forward(ids, 0, every=True) for ids in job["windows"]]
        np.save(out / f"{name}.npy", np.stack(logits).astype(np.float32))
        result["models"][name] = {
            "greedy": greedy,
            "margins": margins,
            "seconds": time.perf_counter() - t0,
        }
    return result


def greedy_ids(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy ids (serving's temperature 0: the argmax) and each step's top-1 margin."""
    ids, margins = [], []
    logits = engine.forward(list(prompt), 0)
    for step in range(n):
        top2 = np.partition(logits, -2)[-2:]
        token = int(np.argmax(logits))
        ids.append(token)
        margins.append(float(top2[1] - top2[0]))
        if step + 1 < n:
            logits = engine.forward([token], len(prompt) + step)
    return ids, margins


# ------------------------------------------------------------------ the comparison (pure)


def first_divergence(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, position) of the first id that differs, or None when all are equal."""
    for p, (a, b) in enumerate(zip(ref, got)):
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b) or a[i] != b[i]:
                return p, i
    return None


def nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean negative log-likelihood (nats) of `targets` [n] under `logits` [n, vocab]."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean())


def window_stats(ref: np.ndarray, got: np.ndarray, windows: list[list[int]]) -> dict:
    """ref, got: [windows, positions, vocab] logits of the same ids on two machines."""
    diff = np.abs(got.astype(np.float64) - ref)
    refs = [ref[w, :-1] for w in range(len(windows))]
    gots = [got[w, :-1] for w in range(len(windows))]
    targets = [np.asarray(ids[1:]) for ids in windows]
    loss_ref = float(np.mean([nll(r, t) for r, t in zip(refs, targets)]))
    loss_got = float(np.mean([nll(g, t) for g, t in zip(gots, targets)]))
    ref_top, got_top = ref.argmax(-1), got.argmax(-1)
    # Where the top-1 moved, how far below x86's own top-1 x86 put ARM's choice: a near-tie
    # (a gap like the logits' rounding) flips on any kernel; a wide gap would be a wrong kernel.
    flips = np.nonzero(ref_top != got_top)
    gaps = ref.max(-1)[flips] - ref[(*flips, got_top[flips])]
    return {
        "positions": int(ref.shape[0] * ref.shape[1]),
        "top1_agreement": float((ref_top == got_top).mean()),
        "flip_max_gap": float(gaps.max()) if gaps.size else 0.0,
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float(diff.max() / (np.abs(ref).max() or 1.0)),  # all-zero: absolute
        "loss_ref": loss_ref,
        "loss_increase": loss_got - loss_ref,
    }


def compare(ref: dict, got: dict, stats: dict, bounds: dict = BOUNDS) -> list[str]:
    """What fails, in words; empty when the model file computes the same on both machines.
    ref/got: one model's worker results (greedy, margins) beside the prompts' token ids."""
    bad = []
    if ref["prompt_ids"] != got["prompt_ids"]:
        bad.append("the tokenizer gives other ids")
    where = first_divergence(ref["greedy"], got["greedy"])
    if where is not None:
        p, i = where
        bad.append(
            f"greedy ids differ from prompt {p}'s position {i} on (x86 top-1 margin there "
            f"{ref['margins'][p][i]:.3g})"
        )
    if stats["top1_agreement"] < bounds["top1_agreement"]:
        bad.append(f"top-1 agreement {stats['top1_agreement']:.4f} < {bounds['top1_agreement']}")
    if stats["max_rel_diff"] > bounds["max_rel_diff"]:
        bad.append(f"max logit difference {stats['max_rel_diff']:.2e} > {bounds['max_rel_diff']}")
    if stats["loss_increase"] > bounds["loss_increase"]:
        bad.append(f"loss increase {stats['loss_increase']:+.5f} > {bounds['loss_increase']}")
    return bad


# ------------------------------------------------------------------ driving both machines


def make_job(
    folder: Path,
    texts: list[Path],
    files: tuple[str, ...] = (),
    prompts: tuple[str, ...] = PROMPTS,
    new_tokens: int = NEW_TOKENS,
    window: int = WINDOW,
) -> dict:
    from tokenizers import Tokenizer

    bundle = read_bundle(folder)
    tok = Tokenizer.from_file(str(bundle.tokenizer))
    ids = [tok.encode(p.read_text(encoding="utf-8")).ids for p in texts]
    # One length for every window, so that each side's logits stack into one array.
    width = min(window, bundle.context_length, *(len(w) for w in ids))
    if width < 2:
        raise ArmError("a held-out text has fewer than 2 tokens; give longer --text files")
    models = [n for n in files or FILES if (folder / n).is_file()]
    return {
        "bundle": str(folder.resolve()),
        "models": models,
        "prompts": list(prompts),
        "prompt_ids": [tok.encode(p).ids for p in prompts],
        "windows": [w[:width] for w in ids],
        "new_tokens": new_tokens,
    }


def run_side(spec: dict, job: dict, work_dir: Path, timeout: float) -> tuple[dict, dict]:
    work_dir.mkdir(parents=True)
    (work_dir / "job.json").write_text(json.dumps(job), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **spec["env"]}
    cmd = [*spec["cmd"], "--worker", str(work_dir)]
    # From the root, which `-m` puts on sys.path: the emulated Python has no doel installed.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ArmError(f"{' '.join(cmd[:2])} failed:\n" + "\n".join(proc.stderr.splitlines()[-8:]))
    result = json.loads((work_dir / "result.json").read_text(encoding="utf-8"))
    logits = {name: np.load(work_dir / f"{name}.npy") for name in job["models"]}
    return result, logits


def check_bundle(folder: Path, env: dict, job: dict, timeout: float) -> list[dict]:
    runs = {}
    with tempfile.TemporaryDirectory(prefix="doel-arm64-") as tmp:
        for i, (side, spec) in enumerate(env.items()):
            print(f"  {folder.name}: {side} ...", file=sys.stderr, flush=True)
            runs[side] = run_side(spec, job, Path(tmp) / str(i), timeout)
    rows = []
    ref_side = "x86_64"
    for side in env:
        if side == ref_side:
            continue
        (ref, ref_logits), (got, got_logits) = runs[ref_side], runs[side]
        for name in job["models"]:
            stats = window_stats(ref_logits[name], got_logits[name], job["windows"])
            a = {"prompt_ids": ref["prompt_ids"], **ref["models"][name]}
            b = {"prompt_ids": got["prompt_ids"], **got["models"][name]}
            where = first_divergence(a["greedy"], b["greedy"])
            rows.append(
                {
                    "bundle": folder.name,
                    "model": name,
                    "quant": job_quant(folder),
                    "side": side,
                    "side_onnxruntime": got["onnxruntime"],
                    "reference": f"{ref_side} onnxruntime {ref['onnxruntime']}",
                    "greedy_equal": where is None,
                    "first_divergence": where,
                    "min_margin": float(min(min(m) for m in a["margins"])),
                    **stats,
                    "seconds": got["models"][name]["seconds"],
                    "failures": compare(a, b, stats),
                }
            )
    return rows


def job_quant(folder: Path) -> str:
    m = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    kv = m["kv_cache"].get("dtype", "float32")
    return f"{m['quantization'].get('bits') or 'fp32'}-bit, kv {kv}"


def markdown(report: dict) -> str:
    intro = (
        f"serve/'s engine on each bundle file, aarch64 under qemu-user {report['qemu']} "
        f"(CPU models: {', '.join(report['cpus'])}) against x86_64, both with onnxruntime "
        f"{report['onnxruntime']}. "
        f"Prompts: {', '.join(repr(t) for t in PROMPTS[: report['prompts']])}, "
        f"{report['new_tokens']} greedy tokens each; held-out "
        f"window: {report['window_positions']} positions. Bounds: {report['bounds']}. "
        f"Host: {report['host']}. Emulated time is no phone's speed."
    )
    lines = opening("ARM64 check", report, intro, "widest x86 gap of a flip")
    lines += [table_row(r) for r in report["rows"]]
    return "\n".join(lines) + "\n"


def opening(title: str, report: dict, intro: str, gap: str, file: bool = True) -> list[str]:
    """The lines above the rows, in this report and check_avx2's: `# TITLE: NAME (DATE)`, what
    ran against what, the run's note if it has one, and the header of table_row's columns (gap:
    the flip column's name), kept beside table_row so that the two cannot drift apart."""
    from benchmarks.common.report import heading  # here: the worker, under qemu, needs no report

    columns = ["bundle", *(["file"] if file else []), "quant", "side", "greedy ids"]
    columns += ["top-1 agree", gap, "max abs diff", "max rel diff", "loss increase (nats/tok)"]
    columns += ["s", "verdict"]
    return [
        *heading(f"{title}: {report['name']}", report, with_machine=False),
        intro,
        "",
        *([report["note"], ""] if report.get("note") else []),
        f"| {' | '.join(columns)} |",
        "|" + "---|" * len(columns),
    ]


def table_row(r: dict, file: bool = True) -> str:
    """One bundle file's row on one side, in this report and check_avx2's (which runs
    model.onnx alone, so names no file): one function, so both tables read the same figures
    the same way. A report from before flip_max_gap was recorded shows `-` there."""
    greedy = "equal" if r["greedy_equal"] else f"differ at {tuple(r['first_divergence'])}"
    gap = f"{r['flip_max_gap']:.2e}" if "flip_max_gap" in r else "-"
    cells = [
        r["bundle"],
        *([r["model"]] if file else []),
        r["quant"],
        r["side"],
        greedy,
        f"{r['top1_agreement']:.4f}",
        gap,
        f"{r['max_abs_diff']:.2e}",
        f"{r['max_rel_diff']:.2e}",
        f"{r['loss_increase']:+.2e}",
        f"{r['seconds']:.1f}",
        "ok" if not r["failures"] else "; ".join(r["failures"]),
    ]
    return f"| {' | '.join(cells)} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+", type=Path, help="doel-export bundle folder(s)")
    p.add_argument("--name", default="demo", help="results file: arm64_NAME.{json,md}")
    p.add_argument("--text", nargs="+", type=Path, help="held-out .txt (default: the sample)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side and bundle")
    p.add_argument("--cpus", nargs="+", choices=CPUS, default=CPUS, help="emulated CPU models")
    p.add_argument("--files", nargs="+", choices=FILES, default=FILES, help="bundle files run")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts only")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="greedy tokens a prompt")
    p.add_argument("--window", type=int, default=WINDOW, help="held-out positions a text")
    p.add_argument("--note", default="", help="a sentence for the report (e.g. random weights)")
    args = p.parse_args(argv)
    texts = args.text or sorted((ROOT / "train" / "sample").glob("*.txt"))
    try:
        env = ensure_env()
        env = {k: v for k, v in env.items() if k == "x86_64" or k.split()[1] in args.cpus}
        sizes = (PROMPTS[: args.prompts], args.new_tokens, args.window)
        jobs = [make_job(b, texts, args.files, *sizes) for b in args.bundles]
        rows = [
            r for b, j in zip(args.bundles, jobs) for r in check_bundle(b, env, j, args.timeout)
        ]
    except (ArmError, BundleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Here, not at the top: the worker (the same module, under qemu) needs none of the report.
    from benchmarks.common.cpu_class import this_cpu
    from benchmarks.common.report import publish

    cpu = this_cpu()
    qemu = subprocess.run(
        [env[f"aarch64 {args.cpus[0]}"]["cmd"][0], "--version"], capture_output=True, text=True
    )
    report = {
        "name": args.name,
        "date": date.today().isoformat(),
        "qemu": qemu.stdout.split()[2] if qemu.stdout else "?",
        "host": f"{cpu['model_name']} ({cpu['class']})",
        "onnxruntime": _version("onnxruntime"),
        "bounds": BOUNDS,
        "cpus": list(args.cpus),
        "note": args.note,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "window_positions": rows[0]["positions"] if rows else 0,
        "rows": rows,
    }
    publish(args.out, f"arm64_{args.name}", report, markdown(report))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        folder = Path(sys.argv[2])
        job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
        (folder / "result.json").write_text(json.dumps(work(job, folder)), encoding="utf-8")
    else:
        sys.exit(main())
