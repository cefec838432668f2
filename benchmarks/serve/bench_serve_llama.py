"""llama.cpp for the serving benchmark: the llama-cpp-python build, and our checkpoint as GGUF.

llama-cpp-python is a benchmark-only dependency (not in pyproject's extras). PyPI has only its
source, and its default native build crashes on machines whose CPU lists AMX (an illegal
`tilezero` in every quantized model), so it is built without AMX; `install_llama_cpp` does that
once and keeps the wheel in ~/.cache/doel/ (6-9 minutes on 2 cores), so a new environment
installs it in seconds.

The GGUF file: `convert_hf_to_gguf.py`, shipped inside llama-cpp-python's source package, writes
f32; `llama_model_quantize` (the wheel does not build the llama-quantize binary) makes q4_0 and
q8_0 from it, choosing each tensor's type as llama-quantize would. Our tokenizer (BPE over
characters with byte fallback and a `Sequence` decoder) goes through the converter's Llama-HF
vocabulary path, which lists only the tokenizer's own tokens, while llama.cpp needs one entry per
embedding row: the converter reads a copy of the checkpoint whose tokenizer.json lists the
unused rows as added tokens `<|unused_N|>`. llama.cpp would split text differently from
`tokenizers` (its "llama" tokenizer expects SentencePiece's word marks), so the benchmark passes
token ids, never text.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

THREADS = 2
LLAMA_VERSION = "0.3.36"
CACHE = Path(os.environ.get("DOEL_CACHE", Path.home() / ".cache" / "doel"))
SDIST = CACHE / "llama-sdist" / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
WHEELS = CACHE / "llama-wheel"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS = f'-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS={NO_AMX}" "-DCMAKE_CXX_FLAGS={NO_AMX}"'
INSTALL_HINT = (
    f"pip download --no-deps --no-binary :all: llama-cpp-python=={LLAMA_VERSION} -d {SDIST.parent}"
    f"\nCMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS='{CMAKE_ARGS}' pip wheel --no-deps -w {WHEELS} "
    f"{SDIST}\npip install {WHEELS}/llama_cpp_python-{LLAMA_VERSION}-*.whl sentencepiece"
    "\n(or: python -m benchmarks.serve.bench_serve --install-llama-cpp)"
)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def install_llama_cpp() -> None:
    """Build the AMX-free wheel once (cached), then install it into this interpreter."""
    pip = [sys.executable, "-m", "pip"]
    if not SDIST.is_file():
        subprocess.run(
            pip
            + [
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_VERSION}",
                "-d",
                str(SDIST.parent),
            ],
            check=True,
        )
    if not list(WHEELS.glob(f"llama_cpp_python-{LLAMA_VERSION}-*.whl")):
        env = os.environ | {"CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
        print(f"building llama-cpp-python {LLAMA_VERSION} without AMX (6-9 min) ...", flush=True)
        subprocess.run(
            pip + ["wheel", "--no-deps", "-w", str(WHEELS), str(SDIST)], env=env, check=True
        )
    (wheel,) = WHEELS.glob(f"llama_cpp_python-{LLAMA_VERSION}-*.whl")
    subprocess.run(pip + ["install", str(wheel), "sentencepiece"], check=True)


def converter() -> Path:
    """convert_hf_to_gguf.py from the llama-cpp-python source package (unpacked once)."""
    src = CACHE / "llama-src"
    script = (
        src / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    )
    if not script.is_file():
        if not SDIST.is_file():
            raise FileNotFoundError(f"{SDIST} is missing; get it with:\n{INSTALL_HINT}")
        with tarfile.open(SDIST) as tar:
            tar.extractall(src, filter="data")
    return script


def gguf_package():
    """llama.cpp's own `gguf` package, vendored beside convert_hf_to_gguf.py (the version of the
    llama.cpp that reads our files, not pip's), imported from that folder by its path: its
    modules import each other as `gguf.x`, so it is registered under that name, as putting its
    folder first on sys.path would, without editing sys.path. An already imported `gguf` (pip's,
    through doel.export.gguf) is kept, as an import after such an edit would keep it."""
    if "gguf" in sys.modules:
        return sys.modules["gguf"]
    init = converter().parent / "gguf-py" / "gguf" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "gguf", init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gguf"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["gguf"]
        raise
    return module


def padded_tokenizer(tokenizer: dict, size: int) -> dict:
    """tokenizer.json with the ids from its size up to `size` listed as unused added tokens."""
    out = json.loads(json.dumps(tokenizer))
    taken = set(out["model"]["vocab"].values()) | {t["id"] for t in out["added_tokens"]}
    for i in range(size):
        if i not in taken:
            out["added_tokens"].append(
                {
                    "id": i,
                    "content": f"<|unused_{i}|>",
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
            )
    return out


@contextlib.contextmanager
def silenced():
    """Point the process's stdout and stderr (file descriptors: C code writes there) at
    /dev/null for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def make_ggufs(ckpt: Path, work: Path, variants: list[str]) -> dict[str, Path]:
    """The checkpoint converted to f32 GGUF, then quantized to each variant."""
    import llama_cpp

    src = work / "gguf-src"  # the checkpoint, with a tokenizer covering every embedding row
    src.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "tokenizer.json" and not (src / f.name).exists():
            (src / f.name).symlink_to(f.resolve())
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tok = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    (src / "tokenizer.json").write_text(json.dumps(padded_tokenizer(tok, vocab)), "utf-8")
    f32 = work / "model-f32.gguf"
    cmd = [sys.executable, str(converter()), str(src), "--outtype", "f32", "--outfile", str(f32)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-3000:]}")
    ftypes = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    made = {}
    for v in variants:
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.nthread = ftypes[v], THREADS
        made[v] = work / f"model-{v}.gguf"
        with silenced():  # llama.cpp logs every tensor
            failed = llama_cpp.llama_model_quantize(
                str(f32).encode(), str(made[v]).encode(), ctypes.byref(p)
            )
        if failed:
            raise SystemExit(f"llama_model_quantize to {v} failed (code {failed})")
    f32.unlink()  # 1.6 GB at 0.4B, not measured
    return made


def gguf_bytes(path: Path) -> dict:
    tensors = gguf_package().GGUFReader(str(path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)  # tied: the table is the head
    emb = sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight" and untied)
    types = sorted({t.tensor_type.name for t in tensors if len(t.shape) > 1})
    return {"total": sum(int(t.n_bytes) for t in tensors), "embedding": emb, "types": types}


def llama_info() -> dict:
    import llama_cpp

    return {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
