"""The page's own WebAssembly decoder (KERNEL): where its weights lie, and its build.

onnxruntime-web has no fast WebAssembly kernel for 4-bit weights
(benchmarks/results/web_probe_cpu-intel-avx512-amx.md), so the page's default WebAssembly mode
runs the bundle's int4 graph on doel's kernel instead: the weights stay 4 bits in memory, as in
the bundle file. `kernel_layout` reads the page's copy of
the bundle graph and returns what the kernel needs (shape numbers and the byte offset of each
tensor in the graph's weights file), or why this graph is not the shape the kernel runs (then
the page uses onnxruntime-web). Only the graph ONNX Runtime's model builder writes for the
Llama architecture is accepted, node by node; anything else is refused, never guessed.

The two .wasm files (WASM) are committed beside KERNEL and rebuilt by
`python -m doel.export.web_kernel` with zig's clang (PyPI `ziglang`, pinned in pyproject's dev
extra); tests/export/test_web_kernel.py checks a rebuild gives the same bytes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import onnx

from doel.export import gate_up

KERNEL = Path(__file__).with_name("web") / "kernel.c"
WASM = {"simd": "doel-kernel.wasm", "relaxed": "doel-kernel-relaxed.wasm"}
FLAGS = {"simd": [], "relaxed": ["-mrelaxed-simd", "-DRELAXED"]}
MAX_ROWS = 128  # prompt tokens a forward: the worker's PREFILL_CHUNK
# kernel.c's enums, in order
GLOBAL = ("emb_q", "emb_s", "norm", "lm_w", "lm_s", "cos", "sin")
LAYER = ("ln1", "qkv_w", "qkv_s", "o_w", "o_s", "ln2", "gate_w", "gate_s", "up_w", "up_s")
LAYER += ("down_w", "down_s")
LINEAR = {"qkv_proj": "qkv", "o_proj": "o", "gate_proj": "gate", "up_proj": "up"}
LINEAR |= {"down_proj": "down"}
# Nodes the kernel does in its own way or not at all: SiLU (Sigmoid, Mul), the attention mask's
# length (Constant ... Gather, Cast) and logits_to_keep (Neg, Slice).
# The matrices the kernel also runs at 8 bits (llama.cpp's mixed placement keeps QKV and down
# finer in some layers), as kernel.c's E_* flags of a layer's number after the config's.
EIGHT = {"qkv": 1, "o": 2, "down": 4}
CARRIED = {"Sigmoid", "Mul", "Constant", "Cast", "ReduceSum", "Sub", "Shape", "Gather"}
CARRIED |= {"Neg", "Slice", "Split"}  # Split: gate|up's halves, read by offset (gate_up.py)


class NotKernelShape(ValueError):
    """The graph is not the one shape kernel.c runs; the message says where."""


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _need(cond: bool, why: str) -> None:
    if not cond:
        raise NotKernelShape(why)


def kernel_layout(model_path: Path) -> dict:
    """{"config", "floats" [eps, scale], "offsets", "tensors"} for kernel.c's dk_init: the
    offsets into the graph's one external weights file, and each one's initializer name;
    NotKernelShape if it is another graph."""
    m = onnx.load(str(model_path), load_external_data=False)
    inits = {i.name: i for i in m.graph.initializer}
    where, files = {}, set()
    for name, t in inits.items():
        ext = {e.key: e.value for e in t.external_data}
        if "location" in ext:
            files.add(ext["location"])
            where[name] = int(ext.get("offset", 0))
    _need(len(files) == 1, f"weights in {len(files)} files, not one")
    glob: dict[str, int] = {}
    layers: list[dict[str, int]] = []
    shape: dict = {}

    def at(name: str) -> int:
        _need(name in where, f"{name} is not in the weights file")
        return where[name]

    def dims(name: str) -> list[int]:
        return list(inits[name].dims)

    norms, fused = [], gate_up.halves(m.graph)  # gate|up's halves, once for the graph
    for node in m.graph.node:
        op, a = node.op_type, _attrs(node)
        if op == "GatherBlockQuantized":
            _need(a.get("bits") == 8 and len(node.input) == 3, "the embedding is not 8-bit")
            _need(inits[node.input[0]].data_type == onnx.TensorProto.UINT8, "embedding type")
            glob["emb_q"], glob["emb_s"] = at(node.input[0]), at(node.input[2])
            shape["vocab"], shape["d"] = dims(node.input[0])
            shape["block"] = a["block_size"]
        elif op in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"):
            norms.append((at(node.input[-1]), a.get("epsilon", 1e-5)))
        elif op == "GroupQueryAttention":
            _need(a.get("do_rotary") == 1 and not a.get("rotary_interleaved"), "rotary kind")
            _need(a.get("local_window_size", -1) == -1 and not a.get("softcap"), "window/softcap")
            _need(len(node.input) >= 9 and node.input[1] == "" and node.input[2] == "", "qkv")
            shape["heads"], shape["kv_heads"] = a["num_heads"], a["kv_num_heads"]
            shape["scale"] = a.get("scale", 0.0)
            glob["cos"], glob["sin"] = at(node.input[7]), at(node.input[8])
            shape["rope_rows"], half = dims(node.input[7])
            shape["head_dim"] = 2 * half
        elif op == "MatMulNBits":
            _need(len(node.input) == 3, f"{node.name} has zero points or a bias")
            _need(a["block_size"] == shape.get("block"), f"{node.name}: another block size")
            w, s = node.input[1], node.input[2]
            hit = re.search(r"layers\.(\d+)\.(?:attn|mlp)\.(\w+)\.MatMul", w)
            if hit and hit.group(2) == gate_up.NAME:  # one B: the gate's N rows, then the up's
                i, half = int(hit.group(1)), fused[node.name]
                _need(a["bits"] == 4 and i <= len(layers), f"{node.name} is {a['bits']}-bit")
                if i == len(layers):
                    layers.append({})
                where[f"{w} (up half)"] = at(w) + half["B"]
                where[f"{s} (up half)"] = at(s) + half["scales"]
                layers[i]["gate_w"], layers[i]["gate_s"] = at(w), at(s)
                layers[i]["up_w"] = where[f"{w} (up half)"]
                layers[i]["up_s"] = where[f"{s} (up half)"]
                shape["ffn"] = half["N"]
            elif hit:
                i, part = int(hit.group(1)), LINEAR.get(hit.group(2))
                finer = a["bits"] == 8 and part in EIGHT
                _need(a["bits"] == 4 or finer, f"{node.name} is {a['bits']}-bit")
                _need(part is not None and i <= len(layers), f"unexpected {w}")
                if i == len(layers):
                    layers.append({})
                layers[i][f"{part}_w"], layers[i][f"{part}_s"] = at(w), at(s)
                layers[i]["eight"] = layers[i].get("eight", 0) | (EIGHT[part] if finer else 0)
                if part == "gate":
                    shape["ffn"] = a["N"]
            else:
                _need(a["bits"] in (4, 8) and a["N"] == shape["vocab"], f"unexpected {w}")
                glob["lm_w"], glob["lm_s"], shape["lm_bits"] = at(w), at(s), a["bits"]
        elif op not in CARRIED:
            raise NotKernelShape(f"a {op} node ({node.name})")
    return _assemble(glob, layers, shape, norms, {v: k for k, v in where.items()})


def _assemble(glob: dict, layers: list[dict], shape: dict, norms: list, names: dict) -> dict:
    """kernel_layout's answer from what its walk over the nodes found (`names`: offset ->
    initializer)."""
    _need(len(norms) == 2 * len(layers) + 1 and layers, "norms do not match the layers")
    _need(len({eps for _, eps in norms}) == 1, "norms with different epsilons")
    eight = [layer.pop("eight", 0) for layer in layers]
    for i, layer in enumerate(layers):
        layer["ln1"], layer["ln2"] = norms[2 * i][0], norms[2 * i + 1][0]
        _need(set(layer) == set(LAYER), f"layer {i} lacks {sorted(set(LAYER) - set(layer))}")
    glob["norm"] = norms[-1][0]
    _need(set(glob) == set(GLOBAL), f"lacks {sorted(set(GLOBAL) - set(glob))}")
    s = shape
    _need(s["d"] % s["block"] == 0 and s["ffn"] % s["block"] == 0, "block size")
    _need(s["block"] % 32 == 0 and s["head_dim"] % 4 == 0, "block or head size")
    config = [len(layers), s["d"], s["heads"], s["kv_heads"], s["head_dim"], s["ffn"]]
    config += [s["vocab"], s["block"], s["rope_rows"], MAX_ROWS, s["lm_bits"], *eight]
    scale = s["scale"] or s["head_dim"] ** -0.5
    offsets = [glob[k] for k in GLOBAL] + [lay[k] for lay in layers for k in LAYER]
    return {
        "config": config,
        "floats": [norms[0][1], scale],
        "offsets": offsets,
        "tensors": [names[o] for o in offsets],  # what each offset is (tests, a reader)
    }


def build(out_dir: Path = KERNEL.parent) -> list[Path]:
    """Compile kernel.c to both .wasm files in `out_dir` with zig's clang."""
    made = []
    for kind, name in WASM.items():
        cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "wasm32-freestanding", "-O3"]
        cmd += ["-msimd128", *FLAGS[kind], "-nostdlib", "-Wl,--no-entry", "-Wl,--strip-all"]
        cmd += ["-o", str(out_dir / name), str(KERNEL)]
        subprocess.run(cmd, check=True)
        made.append(out_dir / name)
    return made


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m doel.export.web_kernel",
        description="rebuild the page's two kernel .wasm files from kernel.c (zig's clang)",
    )
    ap.parse_args(argv)
    for path in build():
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
