"""LiteRT-LM on the imported real model: SmolLM2-135M-Instruct (benchmarks/export/
bench_real_model.py's `imported`) exported with `doel-export --format litertlm` answers as
transformers does, each figure LiteRT-LM's own: its tokenizer gives `tokenizers`' ids for
SmolLM2's byte-level tokenizer; its minja renders the bundle's chat template to transformers'
prompt; a greedy conversation (top_k 1) replies transformers' fp32 text to bench_real_model's
chats (its int4 against transformers' fp32: equal, or counted), ending at <|im_end|> as many
times as transformers' do; and its decode rate beside doel-serve's engine on int4 weights of
both (x86, not a phone; the int4 formats differ: dynamic_int4_block32 and doel's MatMulNBits).

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
from benchmarks.runtimes.litertlm_bundle import model, row, run_probe, tokenizer_rows

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}
LABEL = "SmolLM2's (byte-level, digits split first)"
QUANTS = ("int4",)  # the fp32 conversion is left out for time, as in executorch_smollm2


def rows(work: Path) -> list[dict]:
    from tokenizers import Tokenizer

    from benchmarks.export.bench_real_model import CHATS, NEW_TOKENS, imported
    from benchmarks.runtimes.executorch_pte import once
    from benchmarks.runtimes.genai import validation_lines
    from doel.export.common import ExportError
    from doel.export.litertlm import export_litertlm
    from doel.export.phone import runtime_python

    work.mkdir(parents=True, exist_ok=True)
    try:
        runtime_python("litertlm")
    except ExportError as e:
        return [row("?", "the runtime is installed", str(e).split(";")[0], False)]
    folder = imported(work.parent / "phone-smollm2")
    lt = {}
    for q in QUANTS:
        lt[q] = work / f"litertlm-{q}"
        once(lt[q], lambda q=q: export_litertlm(folder, lt[q], q, force=True, max_seq_len=SEQ))
    lines = validation_lines()
    out = tokenizer_rows(lt["int4"], lines, work, LABEL, folder / "tokenizer.json")
    version, ref = out[0]["version"], transformers_replies(folder)
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    spec = {"bundle": str(model(lt["int4"])), "seq": SEQ, "chats": chats, "reply": True}
    got = run_probe(spec | {"new": NEW_TOKENS}, work)
    bad = sum(a != b for a, b in zip(got["chat"], ref["rendered"]))
    check = "minja's render of SmolLM2's chat template == transformers' prompt"
    out.append(row(version, check, f"{bad} of {len(CHATS)} differ", not bad))
    bad = sum(a.strip() != b.strip() for a, b in zip(got["replies"], ref["texts"]))
    check = (
        f"greedy conversation reply, SmolLM2 int4, == transformers' fp32 reply ({len(CHATS)} chats)"
    )
    out.append(row(version, check, f"{bad} of {len(CHATS)} differ", not bad))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ended = sum(
        len(tok.encode(r, add_special_tokens=False).ids) < NEW_TOKENS for r in got["replies"]
    )
    want = sum(len(r) < NEW_TOKENS for r in ref["replies"])
    check = (
        f"greedy replies that end at <|im_end|> before {NEW_TOKENS} tokens (transformers': {want})"
    )
    out.append(row(version, check, f"{ended} of {len(CHATS)}", ended == want))
    stops = ref["stops"]
    check = "bundle's stop tokens (Engine.eos_token_ids) == transformers' (SmolLM2)"
    out.append(row(version, check, f"{got['stops']} vs {stops}", set(got["stops"]) == set(stops)))
    return out + speed_rows(folder, lt["int4"], lines["en"][0][:200], work, version)


def speed_rows(folder: Path, bundle: Path, text: str, work: Path, version: str) -> list[dict]:
    from tokenizers import Tokenizer

    onnx = onnx_int4(folder)
    ids = Tokenizer.from_file(str(onnx / "tokenizer.json")).encode(text).ids
    doel = engine_rate(onnx, ids, SPEED_NEW)
    spec = {"bundle": str(model(bundle)), "seq": SEQ, "prompts": [text, text], "new": SPEED_NEW}
    rate = max(g["decode_tok_s"] for g in run_probe(spec, work)["gen"])
    mib = model(bundle).stat().st_size / 2**20
    result = (
        f"x86 (not a phone): LiteRT-LM {rate:.1f} tok/s, doel-serve {doel:.1f} tok/s (ratio "
        f"{rate / doel:.2f}); model-int4.litertlm {mib:.0f} MiB"
    )
    check = f"decode tok/s beside doel-serve's engine, SmolLM2 int4, {SPEED_NEW} tokens"
    return [row(version, check, result, True)]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
