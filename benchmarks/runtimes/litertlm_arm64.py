"""LiteRT-LM on ARM64, correctness only (as benchmarks/checks/check_arm64.py does for ONNX
Runtime): PyPI's aarch64 Linux wheel of litert-lm-api 0.18.1 (liblitert-lm.so, nothing else) runs
under qemu-user (check_arm64's cached Debian 12 arm64 root and qemu 10), once per emulated CPU
model, and every figure is LiteRT-LM's own, printed by the same probe (litertlm_bundle.probe) on
aarch64 and on this x86 machine: its tokenizer (`Engine.tokenize`) gives x86's ids on the
validation lines, their blocks and NFD forms, for the default (spm) tokenizer and SmolLM2's; a
greedy session (top_k 1) on the default model's bundles (litertlm_bundle's fp32 and int4) streams
x86's text under each CPU model, its XNNPACK picking that CPU's kernels (plain NEON; dot product;
i8mm, SVE); a greedy conversation on SmolLM2's int4 bundle replies x86's text to two chats
(English, Bengali). Its Python API gives text, not ids or logits, so text is what is compared.
Each machine keeps its own XNNPACK cache (`cache_dir`). Emulated time says nothing of a phone's
speed.

Run alone: `python -m benchmarks.runtimes.litertlm_arm64` prints the rows as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.runtimes.litertlm_bundle import NEW, model, not_installed, row, run_probe

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}
CPUS = ("cortex-a53", "cortex-a76", "max")  # check_arm64's: NEON; + dot product; + i8mm, SVE
WHEEL = ("litert-lm-api==0.18.1", ("manylinux_2_27_aarch64",))  # its one aarch64 Linux wheel
SMOL_CHATS, SMOL_NEW = (0, 5), 32  # SmolLM2 under emulation: an English and a Bengali chat


def bundles(work: Path) -> tuple[dict[str, Path], Path, Path]:
    """(the default model's .litertlm folders by quant, SmolLM2's int4 folder, the imported
    SmolLM2): litertlm_bundle's and litertlm_smollm2's, made here if those have not run."""
    from benchmarks.export.bench_real_model import imported
    from benchmarks.runtimes.executorch_pte import once, shared_model
    from benchmarks.runtimes.executorch_smollm2 import SEQ
    from doel.export.litertlm import export_litertlm

    _, ckpt = shared_model(work)
    lt = {}
    for q in ("fp32", "int4"):
        lt[q] = work.parent / "litertlm_bundle" / f"litertlm-{q}"
        once(lt[q], lambda q=q: export_litertlm(ckpt, lt[q], q, force=True, max_seq_len=256))
    folder = imported(work.parent / "phone-smollm2")
    smol = work.parent / "litertlm_smollm2" / "litertlm-int4"
    once(smol, lambda: export_litertlm(folder, smol, "int4", force=True, max_seq_len=SEQ))
    return lt, smol, folder


def probes(lt: dict, smol: Path, prompts: list, chats: list, texts, work: Path, side, name):
    """The three probes of one machine (`side`: None for x86), each with its own cache folder."""
    from benchmarks.runtimes.executorch_smollm2 import SEQ

    cache = work / f"cache-{name}"
    cache.mkdir(exist_ok=True)
    out = {}
    for key, folder, extra in (
        ("fp32", lt["fp32"], {"fp32": True, "texts": texts or []}),
        ("int4", lt["int4"], {}),
    ):
        spec = {"bundle": str(model(folder)), "seq": 256, "prompts": prompts, "new": NEW}
        out[key] = run_probe(spec | extra | {"cache_dir": str(cache)}, work, side)
    spec = {"bundle": str(model(smol)), "seq": SEQ, "chats": chats, "reply": True}
    spec |= {"new": SMOL_NEW, "texts": texts or [], "cache_dir": str(cache)}
    out["smol"] = run_probe(spec, work, side)
    return out


def rows(work: Path) -> list[dict]:
    from benchmarks.checks.check_arm64 import ArmError, aarch64_python, qemu_version
    from benchmarks.export.bench_real_model import CHATS
    from benchmarks.runtimes.executorch_arm64 import failure, same_ids
    from benchmarks.runtimes.executorch_pte import texts_of
    from benchmarks.runtimes.genai import validation_lines

    if missing := not_installed(work):
        return missing
    try:
        sides = {cpu: aarch64_python([WHEEL[0]], WHEEL[1], cpu) for cpu in CPUS}
    except ArmError as e:
        check = "aarch64 under qemu-user: its environment (check_arm64's root, PyPI's wheel)"
        return [row("?", check, str(e).splitlines()[0][:200], False)]
    lt, smol, _ = bundles(work)
    lines = validation_lines()
    texts = [t for ts in texts_of(lines).values() for t in ts]
    prompts = [ls[i][:80] for ls in lines.values() for i in range(4)]
    chats = [[{"role": "user", "content": CHATS[i]}] for i in SMOL_CHATS]
    x86 = probes(lt, smol, prompts, chats, texts, work, None, "x86_64")
    qemu, out, tokens = qemu_version(sides[CPUS[0]]), [], True
    for cpu in CPUS:
        where = f"aarch64 ({cpu}, qemu-user {qemu})"
        try:  # the tokenizers on the first CPU model it runs on
            arm = probes(lt, smol, prompts, chats, texts if tokens else None, work, sides[cpu], cpu)
        except RuntimeError as e:  # its library may use instructions an older CPU lacks
            out.append(row(x86["fp32"]["version"], f"{where}: the runtime runs", failure(e), False))
            continue
        version = arm["fp32"]["version"]
        if tokens:
            tokens = False
            out += same_ids(arm, x86, f"{where}: Engine.tokenize", len(texts), row, version)
        made = [(k, j, g["text"]) for k in ("fp32", "int4") for j, g in enumerate(arm[k]["gen"])]
        bad = [(k, j) for k, j, t in made if t != x86[k]["gen"][j]["text"]]
        first = f"; first: {bad[0][0]} prompt {bad[0][1]}" if bad else ""
        check = f"{where}: greedy text == x86's, default model .litertlm fp32, int4, {NEW} tokens"
        out.append(row(version, check, f"{len(bad)} of {len(made)} differ{first}", not bad))
        bad = sum(a != b for a, b in zip(arm["smol"]["replies"], x86["smol"]["replies"]))
        check = (
            f"{where}: greedy conversation reply == x86's, SmolLM2 .litertlm int4, at most "
            f"{SMOL_NEW} tokens (an English and a Bengali chat)"
        )
        out.append(row(version, check, f"{bad} of {len(chats)} differ", not bad))
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
