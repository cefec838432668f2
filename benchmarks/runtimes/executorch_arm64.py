"""ExecuTorch on ARM64, correctness only (as benchmarks/checks/check_arm64.py does for ONNX
Runtime): PyPI's aarch64 wheels of executorch 1.5.1 and of what its Python runtime imports run
under qemu-user (check_arm64's cached Debian 12 arm64 root and qemu 10), once per emulated CPU
model, and every figure is ExecuTorch's own, printed by the same probe (executorch_pte.probe) on
aarch64 and on this x86 machine: its tokenizer (pytorch-tokenizers' C++ HFTokenizer) gives x86's
ids on the validation lines, their blocks and NFD forms, for the default (spm) tokenizer and
SmolLM2's; the default model's programs (executorch_pte's fp32, int4 = 8da4w, int8 = 8da8w) give
x86's greedy ids under each CPU model, XNNPACK picking that CPU's kernels (plain NEON; dot
product; i8mm, SVE); SmolLM2's int4 program gives x86's greedy ids on two chats (English,
Bengali). A departure is given with the aarch64 program's own logit margin there. Emulated time
says nothing of a phone's speed.

PyPI's torch 2.13.0 for aarch64 Linux, which ExecuTorch's Python runtime links (libtorch), is the
CUDA build: its nvidia libraries (about 2.8 GB of wheels, cached in DOEL_ARM64_CACHE) load,
though nothing runs on a GPU; a phone app links ExecuTorch's C++ runtime, without torch.

Run alone: `python -m benchmarks.runtimes.executorch_arm64` prints the rows as JSON.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.runtimes.executorch_pte import once, row, run_probe, texts_of

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}
CPUS = ("cortex-a53", "cortex-a76", "max")  # check_arm64's: NEON; + dot product; + i8mm, SVE
NEW = 24  # greedy tokens a prompt, the default model
SMOL_CHATS, SMOL_NEW = (0, 5), 16  # SmolLM2 under emulation: an English and a Bengali chat
ARM_TAGS = (*(f"manylinux_2_{v}_aarch64" for v in range(17, 36)), "manylinux2014_aarch64")
# what ExecuTorch's runtime, runner and tokenizer import, at the x86 venv's versions (no deps:
# pip would read executorch's markers as on x86_64); torch comes with its own dependencies
PURE = (
    "executorch",
    "pytorch-tokenizers",
    "numpy",
    "flatbuffers",
    "ruamel.yaml",
    "sentencepiece",
    "tabulate",
    "tiktoken",
    "regex",
    "requests",
    "urllib3",
    "idna",
    "charset-normalizer",
    "certifi",
    "tokenizers",
    "torchao",
    "tqdm",
    "pyyaml",
    "packaging",
)


def venv_pins(python: Path, names) -> list[str]:
    """`name==version` of each package in the venv of `python`, without a local tag (+cpu)."""
    code = (
        "import sys; from importlib.metadata import version as v; "
        "print(' '.join(f'{n}=={v(n)}' for n in sys.argv[1:]))"
    )
    done = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"reading {python}'s versions: {done.stderr.strip()[-200:]}")
    return [p.split("+")[0] for p in done.stdout.split()]


def failure(e: Exception) -> str:
    """A probe's failure in one line: qemu's own words where it stopped the program."""
    text = str(e)
    if "qemu: " in text:
        return "qemu: " + text.split("qemu: ", 1)[1].split("'", 1)[0]
    return text[:200]


def programs(work: Path) -> tuple[dict[str, Path], Path, Path]:
    """(the default model's .pte folders by quant, SmolLM2's int4 folder, the imported
    SmolLM2): executorch_pte's and executorch_smollm2's, made here if those have not run."""
    from benchmarks.export.bench_real_model import imported
    from benchmarks.runtimes.executorch_pte import shared_model
    from benchmarks.runtimes.executorch_smollm2 import SEQ
    from doel.export.pte import export_pte

    _, ckpt = shared_model(work)
    ptes = {}
    for q in ("fp32", "int4", "int8"):
        ptes[q] = work.parent / "executorch_pte" / f"pte-{q}"
        once(ptes[q], lambda q=q: export_pte(ckpt, ptes[q], q, force=True, max_seq_len=256))
    folder = imported(work.parent / "phone-smollm2")
    smol = work.parent / "executorch_smollm2" / "pte-int4"
    once(smol, lambda: export_pte(folder, smol, "int4", force=True, max_seq_len=SEQ))
    return ptes, smol, folder


def spec(ptes: dict, smol: Path, prompts: dict, texts: list[str] | None, want: dict | None):
    """One probe's work: the tokenizers on `texts` (where given), each program's greedy ids on
    its prompts, held to `want` (x86's ids, by program; none: x86's own run)."""

    def program(key: str, folder: Path, name: str, new: int, extra: dict) -> dict:
        ids = prompts[key]
        return {
            "tokenizer": str(folder / "tokenizer.json"),
            "pte": str(folder / name),
            "gen": ids,
            "want": want[key] if want else [[] for _ in ids],
            "gen_new": new,
        } | extra

    bos = json.loads((ptes["int4"] / "manifest.json").read_text())["executorch"]["add_bos"]
    first = program("fp32", ptes["fp32"], "model-fp32.pte", NEW, {"texts": texts or [], "bos": bos})
    also = [program(q, ptes[q], f"model-{q}.pte", NEW, {}) for q in ("int4", "int8")]
    stops = {"stops": prompts["stops"], "texts": texts or []}
    also.append(program("smol", smol, "model-int4.pte", SMOL_NEW, stops))
    return first | {"also": also}


def flatten(got: dict) -> dict:
    """The probe's answer by program: fp32, int4, int8, smol (its `also` in order)."""
    return dict(zip(("fp32", "int4", "int8", "smol"), [got, *got["also"]]))


def same_ids(arm: dict, x86: dict, who: str, n: int, row, version: str) -> list[dict]:
    """A row a tokenizer (the default spm's, SmolLM2's): its ids on aarch64 == x86's."""
    out = []
    for key, label in (("fp32", "default (spm)"), ("smol", "SmolLM2's (byte-level)")):
        bad = sum(a != b for a, b in zip(arm[key]["ids"], x86[key]["ids"]))
        check = f"{who} ids == x86's, {label}, validation lines, blocks, NFD"
        out.append(row(version, check, f"{bad} of {n} differ", not bad))
    return out


def rows(work: Path) -> list[dict]:
    from tokenizers import Tokenizer

    from benchmarks.checks.check_arm64 import ArmError, aarch64_python, qemu_version
    from benchmarks.runtimes.executorch_smollm2 import transformers_replies
    from benchmarks.runtimes.genai import validation_lines
    from doel.export.common import ExportError
    from doel.export.phone import runtime_python

    work.mkdir(parents=True, exist_ok=True)
    try:
        python = runtime_python("executorch")
    except ExportError as e:
        return [row("?", "the runtime is installed", str(e).split(";")[0], False)]
    try:
        pins, torch = venv_pins(python, PURE), venv_pins(python, ["torch"])
        sides = {cpu: aarch64_python(pins, ARM_TAGS, cpu, with_deps=torch) for cpu in CPUS}
    except (ArmError, RuntimeError) as e:
        check = "aarch64 under qemu-user: its environment (check_arm64's root, PyPI's wheels)"
        return [row("?", check, str(e).splitlines()[0][:200], False)]
    ptes, smol, folder = programs(work)
    lines = validation_lines()
    texts = [t for ts in texts_of(lines).values() for t in ts]
    tok = Tokenizer.from_file(str(ptes["fp32"] / "tokenizer.json"))
    ids = [tok.encode(ls[i][:80]).ids for ls in lines.values() for i in range(4)]
    ref = transformers_replies(folder)
    prompts = {
        "fp32": ids,
        "int4": ids,
        "int8": ids,
        "smol": [ref["prompts"][i] for i in SMOL_CHATS],
    }
    prompts["stops"] = ref["stops"]
    x86 = flatten(run_probe(spec(ptes, smol, prompts, texts, None), work))
    want = {k: v["gen"] for k, v in x86.items()}
    qemu, out = qemu_version(sides[CPUS[0]]), []
    tokens = True
    for cpu in CPUS:
        where = f"aarch64 ({cpu}, qemu-user {qemu})"
        try:  # the tokenizers on the first CPU model it runs on
            job = spec(ptes, smol, prompts, texts if tokens else None, want)
            arm = flatten(run_probe(job, work, sides[cpu]))
        except RuntimeError as e:  # its libraries may use instructions an older CPU lacks
            out.append(row(x86["fp32"]["version"], f"{where}: the runtime runs", failure(e), False))
            continue
        version = arm["fp32"]["version"]
        if tokens:
            tokens = False
            out += same_ids(arm, x86, f"{where}: HFTokenizer", len(texts), row, version)
        for keys, what in (
            (("fp32", "int4", "int8"), f"default model .pte fp32, int4, int8, {NEW} tokens"),
            (("smol",), f"SmolLM2 .pte int4, {SMOL_NEW} tokens"),
        ):
            n = sum(len(prompts[k]) for k in keys)
            # held to x86's ids, the probe finds where each leaves them (a stop included)
            bad = [(k, j, d) for k in keys for j, d in enumerate(arm[k]["departures"]) if d]
            first = ""
            if bad:
                k, j, d = bad[0]
                first = f"; {k} prompt {j}: step {d['step']}, its margin {d['margin']}"
            check = f"{where}: program's greedy ids == x86's, {what} ({n} prompts)"
            out.append(row(version, check, f"{len(bad)} of {n} differ{first}", not bad))
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
