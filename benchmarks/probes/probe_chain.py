"""MatMulNBits alone, one matrix shape at a time, as a decode step meets it (issue 57).

A decode step's matrices, read from a bundle's own graph (K, N, bits, block, accuracy level of
each MatMulNBits node, grouped by role: qkv, o, gate, up, down, the head): for each role a graph
of that matrix repeated with random weights of its format, every copy fed the same one-row input
(so a copy's time is one decode step's call), as many copies as the model has layers and never
fewer than make four times the last-level cache, so that the weights stream from memory as in a
decode step and not from cache. Each role's milliseconds a call, its bytes (packed weights and
scales) and GB/s; the sum over a token's calls is what MatMulNBits alone costs a decode step,
against which probe_ablation.py's "everything else" is read.

A helper of probe_ablation.py (its result carries the table); `python -m
benchmarks.probes.probe_chain BUNDLE` prints the table of one bundle.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

THREADS = 2
LLC_BYTES = 32 * 2**20  # the largest last-level cache of the hosts measured (Zen 4: 32 MiB)
MAX_COPIES = 4096  # a tiny model's matrices stay in cache: its graph would grow without end
# gate_up_proj: gate and up as one matrix (export/gate_up.py), before up_proj, its substring
ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def llc_bytes() -> int:
    """This CPU's last-level cache from sysfs, or LLC_BYTES where it cannot be read."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KM")) * mult)
    return best or LLC_BYTES


def shapes(model: Path) -> dict[str, dict]:
    """{role: K, N, bits, block_size, accuracy_level, per_token (calls a decode step makes)} from
    a graph's MatMulNBits nodes (the role: which of ROLES its name holds); a role whose layers
    differ in bits or block (llama.cpp's mixed placement keeps some QKV and down matrices at 8)
    is one entry a format, "role@bits/block", each with its own calls."""
    import onnx
    from onnx import helper

    m = onnx.load(str(model), load_external_data=False)
    out: dict[str, dict] = {}
    calls: Counter = Counter()
    for n in m.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        role = next((r for r in ROLES if r in n.name or r in n.input[1]), None)
        if role is None:
            raise SystemExit(f"{model}: MatMulNBits {n.name} has no role of {ROLES}")
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        keys = ("K", "N", "bits", "block_size", "accuracy_level")
        s = {k: int(attrs.get(k, 0)) for k in keys}
        key = (role, s["bits"], s["block_size"])
        out.setdefault(key, s)
        calls[key] += 1
    named = {}
    for (role, bits, block), s in sorted(out.items(), key=lambda kv: ROLES.index(kv[0][0])):
        one_format = sum(k[0] == role for k in out) == 1
        named[role if one_format else f"{role}@{bits}/{block}"] = s | {
            "per_token": calls[(role, bits, block)]
        }
    return named


def matrix_bytes(s: dict) -> int:
    """Packed weights and fp32 scales of one matrix (symmetric: no zero points)."""
    blocks = -(-s["K"] // s["block_size"])
    return s["N"] * blocks * (s["block_size"] * s["bits"] // 8 + 4)


def copies_graph(s: dict, copies: int) -> bytes:
    """`copies` MatMulNBits of shape `s`, random weights, each fed the one input x."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    blocks = -(-s["K"] // s["block_size"])
    nodes, inits, outs = [], [], []
    for i in range(copies):
        data = rng.integers(0, 256, (s["N"], blocks, s["block_size"] * s["bits"] // 8), np.uint8)
        scales = (rng.random(s["N"] * blocks, dtype=np.float32) * 0.01).astype(np.float32)
        inits += [
            onnx.numpy_helper.from_array(data, f"b{i}"),
            onnx.numpy_helper.from_array(scales, f"s{i}"),
        ]
        attrs = {k: s[k] for k in ("K", "N", "bits", "block_size", "accuracy_level")}
        nodes.append(
            helper.make_node(
                "MatMulNBits", ["x", f"b{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft", **attrs
            )
        )
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, s["N"]]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, s["K"]])
    graph = helper.make_graph(nodes, "copies", [x], outs, inits)
    opset = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opset).SerializeToString()


def time_role(s: dict, min_copies: int, llc: int, rounds: int = 7) -> dict:
    """One role's ms a call (best of `rounds`), bytes a call and GB/s at one row."""
    import onnxruntime as ort

    per = matrix_bytes(s)
    copies = max(min_copies, min(MAX_COPIES, -(-4 * llc // per)))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(copies_graph(s, copies), opts, providers=["CPUExecutionProvider"])
    x = {"x": np.random.default_rng(1).standard_normal((1, s["K"])).astype(np.float32)}
    for _ in range(2):
        sess.run(None, x)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        sess.run(None, x)
        best = min(best, time.perf_counter() - t0)
    ms = best / copies * 1000
    return s | {"copies": copies, "bytes": per, "ms": ms, "gb_s": per / ms / 1e6}


def chain(model: Path, layers: int) -> dict:
    """Every role of a bundle's graph timed (time_role) and their sum over a decode step."""
    llc = llc_bytes()
    roles = {
        r: time_role(s, layers if r != "lm_head" else 1, llc) for r, s in shapes(model).items()
    }
    step_ms = sum(r["ms"] * r["per_token"] for r in roles.values())
    step_bytes = sum(r["bytes"] * r["per_token"] for r in roles.values())
    return {
        "llc_bytes": llc,
        "roles": roles,
        "step_ms": step_ms,
        "step_bytes": step_bytes,
        "step_gb_s": step_bytes / step_ms / 1e6,
    }


def table(c: dict, read_gb_s: float | None = None) -> list[str]:
    """Markdown rows of a chain(): one a role and the step's sum."""
    pct = "" if read_gb_s is None else " % of the read bandwidth |"
    lines = [
        "| matrix | K × N | bits / block | calls a token | copies timed | MB a call | ms a call "
        f"| GB/s |{pct}",
        "|---|---|---|---:|---:|---:|---:|---:|" + ("---:|" if pct else ""),
    ]
    for role, r in c["roles"].items():
        share = "" if read_gb_s is None else f" {r['gb_s'] / read_gb_s:.0%} |"
        lines.append(
            f"| {role.split('@')[0].removesuffix('_proj')} | {r['K']} × {r['N']} | {r['bits']} / "
            f"{r['block_size']} | {r['per_token']} | {r['copies']} | {r['bytes'] / 1e6:.2f} | "
            f"{r['ms']:.3f} | {r['gb_s']:.1f} |{share}"
        )
    share = "" if read_gb_s is None else f" {c['step_gb_s'] / read_gb_s:.0%} |"
    lines.append(
        f"| **a decode step's matrices** | | | | | {c['step_bytes'] / 1e6:.1f} | "
        f"{c['step_ms']:.2f} | {c['step_gb_s']:.1f} |{share}"
    )
    return lines


if __name__ == "__main__":
    bundle = Path(sys.argv[1])
    cfg = json.loads((bundle / "config.json").read_text())
    print("\n".join(table(chain(bundle / "model.onnx", cfg["num_hidden_layers"]))))
