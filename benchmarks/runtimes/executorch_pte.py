"""ExecuTorch (1.5.1, in its own venv) reads `doel-export --format pte` as doel does, each figure
printed by ExecuTorch itself: pytorch-tokenizers' C++ HFTokenizer (the one its phone runners link)
gives `tokenizers`' ids on the shared validation lines, their blocks and their NFD forms, for the
default (spm) tokenizer and SmolLM2's; the program's greedy ids, run by ExecuTorch's runtime
(XNNPACK), equal doel-serve's on the same weights at fp32, and at int4/int8 (8da4w/8da8w against
doel's MatMulNBits, other quantizers) the first departure is given with the program's own logit
margin there; its LLM runner (TextLLMRunner) streams doel-serve's text, stops where doel-serve
stops (the program's get_eos_ids), and encodes the chat prompt doel-serve renders to doel-serve's
ids; and its decode rate beside doel-serve's engine on the same weights (x86, not a phone).

Run alone: `python -m benchmarks.runtimes.executorch` prints the rows as JSON. The part that runs
inside ExecuTorch's venv is `probe` (this file run as a script, `probe IN.json OUT.json`): it
imports nothing of doel.
"""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

RESULTS = ()  # the aggregator (bench_runtimes) writes runtimes.{json,md}; this module writes none
NEW = 24  # tokens a greedy generation
RUNTIME = "ExecuTorch"


def probe(spec: dict) -> dict:
    """In ExecuTorch's venv: its tokenizer's ids, the program's greedy ids (with the margin at
    the first departure from `want`), the runner's text, stops and decode rate."""
    import platform

    import pytorch_tokenizers as pt
    from executorch.version import __version__

    # torch below, for a program only: the tokenizer alone (an aarch64 check) runs without it
    out = {"version": __version__, "machine": platform.machine()}
    tok = pt.CppHFTokenizer()
    tok.load(spec["tokenizer"])
    out["ids"] = [tok.encode(t, spec.get("bos", 0), 0) for t in spec.get("texts", [])]
    out["plain"] = [tok.encode(t, 0, 0) for t in spec.get("plain", [])]
    if "pte" not in spec:
        return out
    import torch
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(spec["pte"])
    out["eos_ids"] = [int(i) for i in program.load_method("get_eos_ids").execute([])]
    forward = program.load_method("forward")
    # `want`: the reference the first departure (and the margin there) is found against; `refs`:
    # other references by name, each with its own departures, on the same greedy run
    refs = spec.get("refs", {})
    out["gen"], out["departures"] = [], []
    out["ref_departures"] = {name: [] for name in refs}
    for i, (prompt, want) in enumerate(zip(spec.get("gen", []), spec.get("want", []), strict=True)):
        wants = {"": want} | {name: r[i] for name, r in refs.items()}
        logits = forward.execute([torch.tensor([prompt]), torch.tensor([0])])[0][0, -1]
        made, found = [], dict.fromkeys(wants)
        steps = max(len(want), spec.get("gen_new", 0))  # past `want`'s end where asked
        for step in range(steps):
            pick = int(logits.argmax())
            for name, w in wants.items():
                if found[name] is None and step < len(w) and pick != w[step]:
                    margin = float(logits[pick] - logits[w[step]])
                    found[name] = {"step": step, "margin": round(margin, 4)}
            made.append(pick)
            if pick in spec.get("stops", []) or step == steps - 1:
                break
            step_in = [torch.tensor([[pick]]), torch.tensor([len(prompt) + step])]
            logits = forward.execute(step_in)[0][0, -1]
        out["gen"].append(made)
        out["departures"].append(found[""])
        for name in refs:
            out["ref_departures"][name].append(found[name])
    out["runner"] = _runner(spec) if spec.get("prompts") else []
    out["also"] = [probe(more) for more in spec.get("also", [])]  # more programs, one process
    return out


def _runner(spec: dict) -> list[dict]:
    """ExecuTorch's TextLLMRunner on each prompt text: the text it streams, tokens made, decode
    tokens/s from its own stats. The text is read from what the runner prints (its stdout): its
    Python callback gets each piece as a str, which fails on a piece that is part of a character
    (a byte-level token of a Bengali letter)."""
    import ctypes
    import os
    import tempfile

    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    libc = ctypes.CDLL(None)
    runner = TextLLMRunner(spec["pte"], spec["tokenizer"])
    found = []
    for text, bos in spec["prompts"]:
        stats = []
        config = GenerationConfig(echo=False, max_new_tokens=spec.get("new", NEW), temperature=0)
        config.num_bos = bos
        with tempfile.TemporaryFile() as f:
            sys.stdout.flush()
            saved = os.dup(1)
            os.dup2(f.fileno(), 1)
            try:
                runner.generate(text, config, None, stats.append)
            finally:
                libc.fflush(None)
                os.dup2(saved, 1)
                os.close(saved)
            f.seek(0)
            printed = f.read().decode("utf-8", "replace")
        # after the pieces it prints a newline and its stats line ("PyTorchObserver {...}")
        printed = printed.rsplit("\nPyTorchObserver ", 1)[0]
        report = json.loads(stats[-1].to_json_string()) if stats else {}
        made = report.get("generated_tokens", -1) + 1  # and the prefill's token
        found.append({"text": printed, "made": made})
        found[-1]["decode_tok_s"] = report.get("decode_token_per_sec")
        runner.reset()
    return found


def run_probe(spec: dict, work: Path, side: dict | None = None) -> dict:
    """`probe` in ExecuTorch's venv (doel.export.phone.runtime_python names it), or on `side`:
    another interpreter ({"cmd": [...], "env": {...}}, an aarch64 one under qemu)."""
    import os

    from doel.export.phone import runtime_python

    src, dst = work / "executorch-in.json", work / "executorch-out.json"
    src.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    python = side["cmd"] if side else [str(runtime_python("executorch"))]
    cmd = [*python, str(Path(__file__).resolve()), "probe"]
    env = {**os.environ, **side["env"]} if side else None
    # bytes: the runner prints each piece as it comes, a character's bytes split across pieces
    done = subprocess.run(cmd + [str(src), str(dst)], capture_output=True, timeout=3600, env=env)
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise RuntimeError(f"ExecuTorch's probe failed: {err}")
    return json.loads(dst.read_text(encoding="utf-8"))


def texts_of(lines: dict[str, list[str]]) -> dict[str, list[str]]:
    """The validation lines, their blocks and their NFD forms, by name."""
    from benchmarks.runtimes.genai import blocks

    out = {}
    for lang, ls in lines.items():
        out[lang], out[f"{lang} blocks"] = ls, blocks(ls)
        out[f"{lang} NFD"] = [unicodedata.normalize("NFD", t) for t in ls]
    return out


def row(version: str, check: str, result: str, ok: bool) -> dict:
    return {"runtime": RUNTIME, "version": version, "check": check, "result": result, "ok": ok}


def tokenizer_rows(bundle: Path, lines: dict, work: Path, label: str, source: Path) -> list[dict]:
    """pytorch-tokenizers' ids on the bundle's tokenizer.json == tokenizers' on the checkpoint's
    own (`source`; the special tokens the post-processor adds included: the runner's num_bos)."""
    from tokenizers import Tokenizer

    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    bos = manifest["executorch"]["add_bos"]
    ref = Tokenizer.from_file(str(source))
    texts = texts_of(lines)
    flat = [t for ts in texts.values() for t in ts]
    got = run_probe({"tokenizer": str(bundle / "tokenizer.json"), "texts": flat, "bos": bos}, work)
    want, rows, at = [e.ids for e in ref.encode_batch(flat)], [], 0
    for name, ts in texts.items():
        bad = sum(a != b for a, b in zip(got["ids"][at : at + len(ts)], want[at : at + len(ts)]))
        check = f"HFTokenizer ids == tokenizers, {label}, {name} (validation)"
        rows.append(row(got["version"], check, f"{bad} of {len(ts)} differ", not bad))
        at += len(ts)
    return rows


def departures(got: dict, want: list[list[int]]) -> tuple[int, str]:
    """(prompts whose greedy ids differ, where the first differs and by what margin)."""
    bad = [(i, d) for i, d in enumerate(got["departures"]) if d is not None]
    bad += [(i, None) for i, (a, b) in enumerate(zip(got["gen"], want))
            if a[: len(b)] != b and not any(j == i for j, _ in bad)]  # fmt: skip
    if not bad:
        return 0, ""
    i, d = bad[0]
    where = f"; prompt {i}: step {d['step']}, its margin {d['margin']}" if d else ""
    return len(bad), where


def greedy_row(version: str, what: str, got: dict, want: list[list[int]]) -> dict:
    bad, where = departures(got, want)
    return row(version, f"greedy ids == {what}", f"{bad} of {len(want)} differ{where}", not bad)


def once(folder: Path, make) -> Path:
    """`make()` unless FOLDER already holds what it writes (a manifest.json): a rerun of one
    module (bench_runtimes --only, the same --work) reuses the exports of the last run."""
    if not (folder / "manifest.json").exists():
        make()
    return folder


def shared_model(work: Path) -> tuple[dict[str, Path], Path]:
    """genai.build's spm model and its ONNX bundles (int4, int8, fp32: doel-serve's side), made
    once in WORK/../phone-default for every phone runtime's rows (the same weights for each)."""
    from benchmarks.runtimes.genai import build
    from doel.export.bundle import ExportOptions, export_checkpoint

    folder = work.parent / "phone-default"
    bundles = {q: folder / f"bundle-{q}" for q in ("int4", "int8", "fp32")}
    if not all((b / "manifest.json").exists() for b in bundles.values()):
        folder.mkdir(parents=True, exist_ok=True)
        build(folder)
        opts = ExportOptions(quant="fp32", eval_tokens=64, force=True, log=lambda _m: None)
        export_checkpoint(folder / "ckpt", bundles["fp32"], opts)
    return bundles, folder / "ckpt"


def default_rows(work: Path) -> list[dict]:
    """The default (spm) tokenizer on the shared data and a random 4-layer Llama on it
    (genai.build's), exported to ONNX (doel-serve's side) and to .pte at fp32, int4 and int8."""
    from benchmarks.runtimes.genai import CHATS, doel_side, serve_text, validation_lines
    from doel.export.pte import export_pte

    bundles, model = shared_model(work)
    ptes = {}
    for q in ("fp32", "int4", "int8"):
        ptes[q] = work / f"pte-{q}"
        once(ptes[q], lambda q=q: export_pte(model, ptes[q], q, force=True, max_seq_len=256))
    lines = validation_lines()
    rows = tokenizer_rows(ptes["int4"], lines, work, "default (spm)", model / "tokenizer.json")
    prompt_text = [ls[i][:80] for ls in lines.values() for i in range(4)]
    ref = doel_side(bundles["fp32"], prompt_text, [])
    prompts, version = ref["ids"], rows[0]["version"]
    for q in ("fp32", "int4", "int8"):
        side = doel_side(bundles[q], [], prompts)
        spec = {
            "tokenizer": str(ptes[q] / "tokenizer.json"),
            "pte": str(ptes[q] / f"model-{q}.pte"),
        }
        spec |= {"gen": prompts, "want": side["gen"]}
        if q == "fp32":
            spec["prompts"] = [[t, 1] for t in prompt_text] + [[t, 0] for t in ref["chat"]]
            spec["plain"] = ref["chat"]
        got = run_probe(spec, work)
        rows.append(
            greedy_row(version, f"doel-serve's, {q} (.pte {q} vs ONNX {q})", got, side["gen"])
        )
        if q != "fp32":
            continue
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ptes[q] / "tokenizer.json"))
        texts = [serve_text(tok, p, g) for p, g in zip(prompts, side["gen"])]
        made = [(r["text"], t) for r, t in zip(got["runner"], texts) if "\ufffd" not in t]
        bad = sum(a != b for a, b in made)
        check = "TextLLMRunner text == doel-serve's (fp32 greedy, valid UTF-8)"
        rows.append(row(version, check, f"{bad} of {len(made)} differ", not bad))
        stops = [
            i for i in json.loads((ptes[q] / "manifest.json").read_text())["executorch"]["stop_ids"]
        ]
        check = "program's get_eos_ids == doel-serve's stop tokens (EOS, end of turn)"
        rows.append(row(version, check, f"{got['eos_ids']} vs {stops}", got["eos_ids"] == stops))
        bad = sum(a != b for a, b in zip(got["plain"], ref["chat_ids"]))
        check = "HFTokenizer ids of doel-serve's rendered chat prompt == doel-serve's chat ids"
        rows.append(row(version, check, f"{bad} of {len(CHATS)} differ", not bad))
    return rows


def rows(work: Path) -> list[dict]:
    from doel.export.common import ExportError
    from doel.export.phone import runtime_python

    work.mkdir(parents=True, exist_ok=True)
    try:
        runtime_python("executorch")
    except ExportError as e:
        return [row("?", "the runtime is installed", str(e).split(";")[0], False)]
    return default_rows(work)


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        spec = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        Path(sys.argv[3]).write_text(json.dumps(probe(spec), ensure_ascii=False), "utf-8")
    else:
        main()
