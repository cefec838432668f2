"""LiteRT-LM on the imported real model: SmolLM2-135M-Instruct (benchmarks/export/
bench_real_model.py's `imported`) exported with `doel-export --format litertlm` answers as
transformers does, each figure LiteRT-LM's own: its tokenizer gives `tokenizers`' ids for
SmolLM2's byte-level tokenizer; its minja renders the bundle's chat template to transformers'
prompt; a greedy conversation (top_k 1) on the fp32 bundle (fp32 activations) replies
transformers' fp32 text to bench_real_model's chats, ending at <|im_end|> where transformers'
replies do; the int4 bundle's replies are reported where they depart, at the first token that
leaves transformers' greedy ids, with transformers' fp32 logit margin there (LiteRT-LM's Python
API gives text, not logits); and its decode rate beside doel-serve's engine on int4 weights of
both (x86, not a phone, 2 threads each; the int4 formats differ: dynamic_int4_block32 and doel's
MatMulNBits).

Run alone: `python -m benchmarks.runtimes.litertlm_smollm2` prints the rows as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.runtimes.executorch_smollm2 import (
    SEQ,
    SPEED_NEW,
    engine_rate,
    onnx_int4,
    transformers_replies,
)
from benchmarks.runtimes.litertlm_bundle import model, not_installed, row, run_probe, tokenizer_rows

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}
LABEL = "SmolLM2's (byte-level, digits split first)"
QUANTS = ("fp32", "int4")  # fp32: held to transformers' replies; int4: departures reported


def rows(work: Path) -> list[dict]:
    from tokenizers import Tokenizer

    from benchmarks.export.bench_real_model import CHATS, NEW_TOKENS, imported
    from benchmarks.runtimes.executorch_pte import once
    from benchmarks.runtimes.genai import validation_lines
    from doel.export.litertlm import export_litertlm

    if missing := not_installed(work):
        return missing
    folder = imported(work.parent / "phone-smollm2")
    lt = {}
    for q in QUANTS:
        lt[q] = work / f"litertlm-{q}"
        once(lt[q], lambda q=q: export_litertlm(folder, lt[q], q, force=True, max_seq_len=SEQ))
    lines = validation_lines()
    out = tokenizer_rows(lt["int4"], lines, work, LABEL, folder / "tokenizer.json")
    version, ref = out[0]["version"], transformers_replies(folder)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for q in QUANTS:
        spec = {"bundle": str(model(lt[q])), "seq": SEQ, "chats": chats, "reply": True}
        got = run_probe(spec | {"new": NEW_TOKENS, "fp32": q == "fp32"}, work)
        if q == "int4":
            bad = sum(a != b for a, b in zip(got["chat"], ref["rendered"]))
            check = "minja's render of SmolLM2's chat template == transformers' prompt"
            out.append(row(version, check, f"{bad} of {len(CHATS)} differ", not bad))
        found = departures(folder, ref, got["replies"])
        at = [(i, d) for i, d in enumerate(found) if d is not None]
        where = ", ".join(f"{i}: step {d['step']} margin {d['margin']}" for i, d in at)
        where = f" (prompt: first step, transformers' fp32 margin there: {where})" if at else ""
        what = f"SmolLM2 {q}, == transformers' fp32 reply ({len(CHATS)} chats)"
        if q == "fp32":
            check = f"greedy conversation reply, {what}"
            out.append(row(version, check, f"{len(at)} of {len(CHATS)} differ{where}", not at))
        else:
            check = f"greedy conversation reply, {what} (reported: int4 against fp32)"
            out.append(row(version, check, f"{len(at)} of {len(CHATS)} depart{where}", True))
        ended = sum(
            len(tok.encode(r, add_special_tokens=False).ids) < NEW_TOKENS for r in got["replies"]
        )
        want = sum(len(r) < NEW_TOKENS for r in ref["replies"])
        check = (
            f"greedy replies that end at <|im_end|> before {NEW_TOKENS} tokens, SmolLM2 {q} "
            f"(transformers': {want})"
        )
        check += "" if q == "fp32" else " (reported: int4)"
        out.append(row(version, check, f"{ended} of {len(CHATS)}", ended == want or q != "fp32"))
    stops = ref["stops"]
    check = "bundle's stop tokens (Engine.eos_token_ids) == transformers' (SmolLM2)"
    out.append(row(version, check, f"{got['stops']} vs {stops}", set(got["stops"]) == set(stops)))
    return out + speed_rows(folder, lt["int4"], lines["en"][0][:200], work, version)


def departures(folder: Path, ref: dict, replies: list[str]) -> list[dict | None]:
    """Where each LiteRT-LM reply (text) leaves transformers' greedy ids: the first step whose
    token's text is not the reply's next text, and transformers' fp32 margin there (its token's
    logit over the one LiteRT-LM's text has at that step, re-encoded by `tokenizers`: None where
    the two encodings part before it). None for a reply equal to transformers'."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    stop, model, out = ref["stops"][0], None, []
    for prompt, ids, text, said in zip(ref["prompts"], ref["replies"], ref["texts"], replies):
        if said.strip() == text.strip():
            out.append(None)
            continue
        said = said.lstrip()
        step = len(ids)  # where transformers stopped and LiteRT-LM went on
        for k in range(len(ids)):
            head = tok.decode(ids[: k + 1]).lstrip()
            if not head.endswith("\ufffd") and not said.startswith(head):
                step = k
                break
        own = tok.encode(said, add_special_tokens=False).ids + [stop]
        margin = None
        if own[:step] == ids[:step] and step < len(own):
            model = model or AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + ids[:step]])).logits[0, -1]
            theirs = ids[step] if step < len(ids) else stop
            margin = round(float(logits[theirs] - logits[own[step]]), 4)
        out.append({"step": step, "margin": margin})
    return out


def speed_rows(folder: Path, bundle: Path, text: str, work: Path, version: str) -> list[dict]:
    from tokenizers import Tokenizer

    onnx = onnx_int4(folder)
    ids = Tokenizer.from_file(str(onnx / "tokenizer.json")).encode(text).ids
    doel = engine_rate(onnx, ids, SPEED_NEW)
    spec = {"bundle": str(model(bundle)), "seq": SEQ, "prompts": [text, text], "new": SPEED_NEW}
    rate = max(g["decode_tok_s"] for g in run_probe(spec | {"threads": 2}, work)["gen"])
    mib = model(bundle).stat().st_size / 2**20
    onnx_mib = sum(p.stat().st_size for p in onnx.glob("*.onnx*")) / 2**20
    result = (
        f"x86 (not a phone), 2 threads: LiteRT-LM {rate:.1f} tok/s, doel-serve {doel:.1f} tok/s "
        f"(ratio {rate / doel:.2f}); model-int4.litertlm {mib:.0f} MiB, doel's int4 ONNX "
        f"{onnx_mib:.0f} MiB"
    )
    check = f"decode tok/s beside doel-serve's engine, SmolLM2 int4, {SPEED_NEW} tokens"
    return [row(version, check, result, True)]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
