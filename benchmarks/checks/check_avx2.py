"""AVX2 check: does a bundle compute the same tokens on an AVX2-only x86 as on this machine?

Many laptops and cloud CPUs still have AVX2 and FMA but no AVX-512 or VNNI (issue 22's AMD EPYC
host was one), and ONNX Runtime's MLAS picks other kernels there (by CPUID, at load). With no
such host here, serve/'s engine runs each bundle under qemu-user's x86_64 emulator with an
AVX2-only CPU model (default EPYC-Rome: AVX2, FMA, F16C; no AVX-512, no VNNI), in this very
venv, and natively; the comparison, bounds and worker are benchmarks/checks/check_arm64.py's. Before
that, the emulated CPU is asked what it has (numpy's CPU dispatch, which reads CPUID as MLAS
does): the check refuses to run if AVX-512 shows through.

It also runs a probe that decides an export choice: ONNX Runtime's plain int8 GEMM
(MatMulInteger) with uint8 activations and int8 weights of the full range, against the exact
integer product, natively and emulated. On AVX2 without VNNI, MLAS multiplies such pairs with a
16-bit saturating instruction (vpmaddubsw), so large products overflow; uint8 x uint8 takes
another path. Why doel's int8 bundles keep MatMulNBits rather than that faster prefill GEMM:
benchmarks/results/avx2_*.md.

Emulated time says nothing about an AVX2 host's speed; only correctness is checked. Needs
qemu-user-static (`apt-get install qemu-user-static`; Debian 12's 7.2 emulates AVX2). Run:
`python -m benchmarks.checks.check_avx2 BUNDLE [BUNDLE ...] --name NAME`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.checks import check_arm64 as arm  # (its worker runs on both sides)

RESULTS = ("avx2_<name>",)

ROOT = Path(__file__).resolve().parents[2]

CPUS = ("EPYC-Rome", "EPYC-Milan", "Haswell")  # AVX2 + FMA, no AVX-512: AMD Zen 2/3, Intel
FEATURES = ("AVX2", "FMA3", "AVX512F", "AVX512_VNNI", "AVX512VNNI")
PROBE_K, PROBE_N = 1024, 1024


class Avx2Error(Exception):
    """The check cannot run here; the message says what to install or fix."""


def find_qemu() -> str:
    for name in ("qemu-x86_64-static", "qemu-x86_64"):
        if path := shutil.which(name):
            return path
    raise Avx2Error("no x86_64 emulator: apt-get install qemu-user-static")


def guest_command(qemu: str, cpu: str) -> list[str]:
    """This venv's Python under qemu's x86_64 emulator with CPU model `cpu`."""
    return [qemu, "-cpu", cpu, sys.executable]


def _quiet(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    # qemu names every host CPUID bit its emulator lacks on stderr; only failures matter.
    # From the root, where `-m` finds the benchmarks package under any interpreter.
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def cpu_features(prefix: list[str]) -> dict[str, bool]:
    """The features numpy's dispatcher found on the CPU that `prefix` runs Python on."""
    code = (
        "import json; from numpy._core._multiarray_umath import __cpu_features__ as f; "
        f"print(json.dumps({{k: bool(f.get(k)) for k in {list(FEATURES)!r} if k in f}}))"
    )
    proc = _quiet([*prefix, "-c", code], 300)
    if proc.returncode != 0:
        raise Avx2Error(f"{' '.join(prefix[:3])} failed:\n{proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def is_avx2_only(features: dict[str, bool]) -> bool:
    return features.get("AVX2", False) and not any(
        features.get(k, False) for k in ("AVX512F", "AVX512_VNNI", "AVX512VNNI")
    )


# ------------------------------------------------------------------ the int8 GEMM probe


def gemm_probe() -> dict:
    """Relative error of MatMulInteger against the exact product, for activations quantized per
    row to uint8 (zero point 128, as a per-row dynamic quantization would) and weights of the
    full int8 range, as int8 (u8 x s8) and shifted to uint8 (u8 x u8, zero point 128)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = np.clip(np.round(rng.standard_normal((PROBE_K, PROBE_N)) * 42), -127, 127)
    x = rng.standard_normal((16, PROBE_K))
    a = np.clip(np.round(x / np.abs(x).max(1, keepdims=True) * 127) + 128, 0, 255)
    exact = (a - 128) @ w
    out = {}
    for kind, b, b_zp in (("u8 x s8", w.astype(np.int8), None), ("u8 x u8", w + 128, 128)):
        b = b.astype(np.int8 if b_zp is None else np.uint8)
        inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.uint8(128), "azp")]
        names = ["a", "b", "azp"]
        if b_zp is not None:
            inits.append(numpy_helper.from_array(np.uint8(b_zp), "bzp"))
            names.append("bzp")
        graph = helper.make_graph(
            [helper.make_node("MatMulInteger", names, ["y"])],
            "probe",
            [helper.make_tensor_value_info("a", TensorProto.UINT8, ["m", PROBE_K])],
            [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", PROBE_N])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        y = s.run(None, {"a": a.astype(np.uint8)})[0]
        out[kind] = float(np.abs(y - exact).max() / np.abs(exact).max())
    return out


def run_probe(prefix: list[str], timeout: float) -> dict:
    proc = _quiet([*prefix, "-m", "benchmarks.checks.check_avx2", "--probe"], timeout)
    if proc.returncode != 0:
        raise Avx2Error(f"the GEMM probe failed:\n{proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the report


def markdown(report: dict) -> str:
    intro = (
        f"serve/'s engine on each bundle, under qemu-user {report['qemu']}'s x86_64 emulator "
        f"with CPU model {report['cpu']} (what numpy's dispatch finds there: "
        f"{report['guest_features']}), against this host natively ({report['host']}: "
        f"{report['host_features']}), both with onnxruntime {report['onnxruntime']} in the same "
        f"venv. Prompts: {report['prompts']} of check_arm64.py's, {report['new_tokens']} "
        f"greedy tokens each; held-out windows: {report['window_positions']} positions. Bounds "
        f"(check_arm64.py's): {report['bounds']}. Emulated time is no AVX2 host's speed."
    )
    lines = arm.opening("AVX2 check", report, intro, "widest gap of a flip", file=False)
    lines += [arm.table_row(r, file=False) for r in report["rows"]]
    return "\n".join(lines + gemm_section(report["cpu"], report["gemm_probe"]))


# Why the probe decides an export choice: the closing paragraph of the report's GEMM section.
GEMM_VERDICT = (
    "u8 × s8 is the fast int8 GEMM where VNNI exists; on AVX2 alone MLAS sums pairs of "
    "products in 16 bits with saturation, and weights of the full range overflow it. A "
    "bundle that ran its prefill through it (per-row activations, faster than MatMulNBits "
    "for many rows) would be wrong on exactly the hosts it was meant for, unless its "
    "weights kept 7 bits or it took the u8 × u8 path; doel's int8 stays on MatMulNBits."
)


def gemm_section(cpu: str, probe: dict) -> list[str]:
    """The GEMM probe's section: its error natively and on the emulated CPU, and what that
    decides (GEMM_VERDICT)."""
    lines = [
        "",
        "## ONNX Runtime's int8 GEMM (MatMulInteger): error against the exact product",
        "",
        f"16 rows of activations quantized per row to uint8, weights of the full int8 range, "
        f"{PROBE_K} x {PROBE_N}; largest error over the largest exact value.",
        "",
        "| operands | native | " + cpu + " (emulated) |",
        "|---|---:|---:|",
    ]
    for kind in probe["native"]:
        lines.append(f"| {kind} | {probe['native'][kind]:.2e} | {probe['guest'][kind]:.2e} |")
    return [*lines, "", GEMM_VERDICT, ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", nargs="+", type=Path, help="doel-export bundle folder(s)")
    p.add_argument("--name", default="demo", help="results file: avx2_NAME.{json,md}")
    p.add_argument("--cpu", choices=CPUS, default=CPUS[0], help="emulated CPU model")
    p.add_argument("--text", nargs="+", type=Path, help="held-out .txt (default: the sample)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side and bundle")
    p.add_argument("--prompts", type=int, default=len(arm.PROMPTS), help="the first N prompts")
    p.add_argument("--new-tokens", type=int, default=arm.NEW_TOKENS, help="greedy tokens each")
    p.add_argument("--window", type=int, default=arm.WINDOW, help="held-out positions a text")
    p.add_argument("--note", default="", help="a sentence for the report")
    args = p.parse_args(argv)
    texts = args.text or sorted((ROOT / "train" / "sample").glob("*.txt"))
    side = f"x86_64 {args.cpu} (emulated)"
    try:
        qemu = find_qemu()
        guest = guest_command(qemu, args.cpu)
        host_features, guest_features = cpu_features([sys.executable]), cpu_features(guest)
        if not is_avx2_only(guest_features):
            raise Avx2Error(f"qemu's {args.cpu} is not AVX2-only here: {guest_features}")
        probe = {"native": gemm_probe(), "guest": run_probe(guest, args.timeout)}
        env = {
            "x86_64": {"cmd": [sys.executable, *arm.WORKER], "env": {}},
            side: {"cmd": [*guest, *arm.WORKER], "env": {}},
        }
        sizes = (arm.PROMPTS[: args.prompts], args.new_tokens, args.window)
        jobs = [arm.make_job(b, texts, ("model.onnx",), *sizes) for b in args.bundles]
        rows = [
            r for b, j in zip(args.bundles, jobs) for r in arm.check_bundle(b, env, j, args.timeout)
        ]
    except (Avx2Error, arm.ArmError, arm.BundleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from benchmarks.common.cpu_class import this_cpu
    from benchmarks.common.report import publish

    cpu = this_cpu()
    version = _quiet([qemu, "--version"], 60).stdout.split()
    report = {
        "name": args.name,
        "date": date.today().isoformat(),
        "qemu": version[2] if len(version) > 2 else "?",
        "cpu": args.cpu,
        "host": f"{cpu['model_name']} ({cpu['class']})",
        "host_features": host_features,
        "guest_features": guest_features,
        "onnxruntime": arm._version("onnxruntime"),
        "bounds": arm.BOUNDS,
        "note": args.note,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "window_positions": rows[0]["positions"] if rows else 0,
        "gemm_probe": probe,
        "rows": rows,
    }
    publish(args.out, f"avx2_{args.name}", report, markdown(report))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        print(json.dumps(gemm_probe()))
    else:
        sys.exit(main())
