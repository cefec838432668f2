"""What the phone runtimes' exports share (export/pte.py for ExecuTorch, export/litertlm.py for
LiteRT-LM): each runtime's converter runs in a venv of its own, because each pins a torch (and
torchao) of its own that doel's cannot be; the export hands it files only (the checkpoint's
config.json and safetensors, a JSON spec) and takes files back, never a pickle.

The venvs live in ~/.cache/doel (DOEL_CACHE), made by .ci/outside_tools; `runtime_python` names
the pip line that makes one where it is missing. The bundle beside the model file holds what an
app's LLM runner reads besides the weights: tokenizer.json, tokenizer_config.json (the chat
template, the BOS/EOS tokens) and manifest.json with the stop tokens and the context length.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from doel.export.checkpoint import Checkpoint, inspect_checkpoint
from doel.export.common import ExportError, write_json

QUANTS = ("int4", "int8", "fp32")  # --quant for the phone formats (each builder's SCHEMES)
DEFAULT_QUANT = "int4"
DEFAULT_MAX_SEQ = 2048  # positions the program's KV cache holds, at most the model's context

CACHE = Path(os.environ.get("DOEL_CACHE", Path.home() / ".cache" / "doel"))
VENVS = {  # runtime -> (venv folder, what to pip install into it)
    "executorch": ("executorch-venv", "executorch==1.5.1 torch safetensors tokenizers"),
    # litert-torch's converter imports TensorFlow's TFLite schema
    "litertlm": (
        "litertlm-venv",
        "litert-lm-api==0.18.1 litert-torch==0.10.0 tensorflow-cpu tokenizers",
    ),
}


def runtime_python(runtime: str) -> Path:
    """The interpreter of `runtime`'s venv; ExportError with the line that makes it otherwise."""
    folder, packages = VENVS[runtime]
    python = CACHE / folder / "bin" / "python"
    if not python.exists():
        raise ExportError(
            f"{runtime} is not installed at {python.parent.parent}; make its venv: python3 -m "
            f"venv {python.parent.parent} && {python.parent / 'pip'} install {packages} "
            "(.ci/outside_tools does)"
        )
    return python


def run_script(python: Path, script: Path, spec: dict, work: Path, timeout: int = 3600) -> dict:
    """`python script SPEC.json OUT.json` in the runtime's venv; its JSON answer. A failure is an
    ExportError quoting the script's last error line."""
    src, dst = work / f"{script.stem}-in.json", work / f"{script.stem}-out.json"
    src.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cmd = [str(python), str(script), str(src), str(dst)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    src.unlink(missing_ok=True)
    if done.returncode != 0 or not dst.exists():
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
        raise ExportError(f"{script.name} failed in {python.parent.parent}: {last.strip()}")
    out = json.loads(dst.read_text(encoding="utf-8"))
    dst.unlink()
    return out


def opening(checkpoint, fmt: str, runtime: str, quant: str, tokenizer, max_seq_len, verify: bool):
    """What both exports begin with, checked: (the checkpoint, the runtime venv's python, the
    positions its cache holds, tokenizer.json as read)."""
    if quant not in QUANTS:
        raise ExportError(f"--quant {quant!r}: --format {fmt} makes {', '.join(QUANTS)}")
    ckpt = inspect_checkpoint(checkpoint, tokenizer, verify=verify)
    check_llama(ckpt, fmt)
    python = runtime_python(runtime)
    seq = min(max_seq_len or DEFAULT_MAX_SEQ, ckpt.context_length)
    if seq < 2:
        raise ExportError(f"--max-seq-len {seq}: the model needs at least 2 positions")
    return ckpt, python, seq, json.loads(ckpt.tokenizer.read_text(encoding="utf-8"))


def check_llama(ckpt: Checkpoint, what: str) -> None:
    """The converters write Llama's graph only, without the options that change it."""
    cfg = ckpt.config
    if ckpt.model_type != "llama":
        raise ExportError(f"--format {what} writes Llama models; this one is {ckpt.model_type!r}")
    for key in ("attention_bias", "mlp_bias", "rope_scaling"):
        if cfg.get(key):
            raise ExportError(f"config.json sets {key}, which --format {what} does not carry")


def stop_ids(ckpt: Checkpoint) -> list[int]:
    """Every token that ends a generation: EOS and the chat's end of turn, in that order."""
    ids = [ckpt.special_tokens[r]["id"] for r in ("eos", "end_of_turn") if r in ckpt.special_tokens]
    return list(dict.fromkeys(ids))


def bos_id(ckpt: Checkpoint) -> int:
    bos = ckpt.special_tokens.get("bos") or ckpt.special_tokens.get("eos")
    return int(bos["id"]) if bos else 0


def adds_bos(tok: dict) -> bool:
    """Whether tokenizer.json's post-processor puts a special token before the text (the app
    asks the runner for one BOS then: ExecuTorch's `num_bos=1`)."""
    post = tok.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for s in steps:
        single = s.get("single") if s.get("type") == "TemplateProcessing" else None
        if single and "SpecialToken" in single[0]:
            return True
    return False


def copy_side_files(ckpt: Checkpoint, stage: Path) -> None:
    """tokenizer_config.json (with the chat template written in, where the checkpoint keeps it in
    chat_template.jinja) and special_tokens_map.json, where the checkpoint has them."""
    config_path = ckpt.tokenizer.parent / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    if ckpt.chat_template is not None:
        config["chat_template"] = ckpt.chat_template
    write_json(stage / "tokenizer_config.json", config)
    special = ckpt.tokenizer.parent / "special_tokens_map.json"
    if special.exists():
        shutil.copyfile(special, stage / special.name)


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
