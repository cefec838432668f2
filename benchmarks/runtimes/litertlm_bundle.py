"""LiteRT-LM (litert-lm-api 0.18.1, in its own venv) reads `doel-export --format litertlm` as doel
does, each figure printed by LiteRT-LM itself: its own tokenizer (`Engine.tokenize`, the C++ one
its Android, iOS and desktop APIs share) gives `tokenizers`' ids on the shared validation lines,
their blocks and their NFD forms; a greedy session (top_k 1) on a prompt streams doel-serve's
text on the same weights (fp32; int4 = dynamic_int4_block32 against doel's int4 counted apart);
the bundle's stop tokens are doel-serve's; its minja renders the bundle's chat template to
doel-serve's prompt (with the start token it adds, doel-serve's ids); and its decode rate from its
own benchmark info, beside doel-serve's engine (x86, not a phone). On the default (spm) tokenizer
and random 4-layer model of genai.build, and on the imported SmolLM2-135M-Instruct, whose chat
replies are held to transformers'.

Run alone: `python -m benchmarks.runtimes.litertlm_bundle` prints the rows as JSON. `probe` (this
file run as a script in LiteRT-LM's venv) imports nothing of doel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = ()  # bench_runtimes writes runtimes.{json,md}
RUNTIME = "LiteRT-LM"
NEW = 24


def probe(spec: dict) -> dict:
    """In LiteRT-LM's venv: tokenize, greedy sessions, chat renders and replies, stops, rates."""
    import platform
    from importlib.metadata import version

    import litert_lm as lm

    # fp32 activations where the weights are fp32 (LiteRT-LM's CPU default is fp16)
    kind = lm.ActivationDataType.FLOAT32 if spec.get("fp32") else None
    engine = lm.Engine(
        spec["bundle"],
        backend=lm.Backend.CPU(thread_count=spec.get("threads")),
        max_num_tokens=spec["seq"],
        enable_benchmark=True,
        activation_data_type=kind,
        cache_dir=spec.get("cache_dir"),  # its XNNPACK cache: apart for each machine checked
    )
    out = {"version": version("litert-lm-api"), "start": engine.bos_token_id}
    out["machine"] = platform.machine()
    out["stops"] = [ids[0] for ids in engine.eos_token_ids]
    out["ids"] = [engine.tokenize(t) for t in spec.get("texts", [])]
    greedy = lm.SamplerConfig(top_k=1, temperature=0.0)
    out["gen"] = []
    for text in spec.get("prompts", []):
        session = engine.create_session(
            apply_prompt_template=False, sampler_config=greedy, max_output_tokens=spec["new"]
        )
        session.run_prefill([text])
        made = session.run_decode().texts[0]
        info = session.get_benchmark_info()
        out["gen"].append({"text": made, "decode_tok_s": info.last_decode_tokens_per_second})
        session.close()
    out["chat"], out["replies"] = [], []
    for chat in spec.get("chats", []):
        conv = engine.create_conversation(messages=chat[:-1], sampler_config=greedy)
        out["chat"].append(conv.render_message_to_string(chat[-1]))
        conv.close()
        if spec.get("reply"):
            conv = engine.create_conversation(
                messages=chat[:-1], sampler_config=greedy, max_output_tokens=spec["new"]
            )
            said = conv.send_message(chat[-1])
            content = (said.to_json() if hasattr(said, "to_json") else said).get("content", "")
            parts = [content] if isinstance(content, str) else [c.get("text", "") for c in content]
            out["replies"].append("".join(parts))
            conv.close()
    return out


def run_probe(spec: dict, work: Path, side: dict | None = None) -> dict:
    """`probe` in LiteRT-LM's venv, or on `side` ({"cmd": [...], "env": {...}}: an aarch64
    interpreter under qemu)."""
    import os

    from doel.export.phone import runtime_python

    src, dst = work / "litertlm-in.json", work / "litertlm-out.json"
    src.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    python = side["cmd"] if side else [str(runtime_python("litertlm"))]
    cmd = [*python, str(Path(__file__).resolve()), "probe"]
    env = {**os.environ, **side["env"]} if side else None
    done = subprocess.run(cmd + [str(src), str(dst)], capture_output=True, timeout=3600, env=env)
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise RuntimeError(f"LiteRT-LM's probe failed: {err}")
    return json.loads(dst.read_text(encoding="utf-8"))


def row(version: str, check: str, result: str, ok: bool) -> dict:
    return {"runtime": RUNTIME, "version": version, "check": check, "result": result, "ok": ok}


def tokenizer_rows(bundle: Path, lines: dict, work: Path, label: str, source: Path) -> list[dict]:
    """LiteRT-LM's ids == tokenizers' on the checkpoint's own tokenizer.json (`source`), without
    special tokens (LiteRT-LM adds the start token itself)."""
    from tokenizers import Tokenizer

    from benchmarks.runtimes.executorch_pte import texts_of

    seq = json.loads((bundle / "manifest.json").read_text())["context_length"]
    ref = Tokenizer.from_file(str(source))
    texts = texts_of(lines)
    flat = [t for ts in texts.values() for t in ts]
    got = run_probe({"bundle": str(model(bundle)), "seq": seq, "texts": flat}, work)
    want = [e.ids for e in ref.encode_batch(flat, add_special_tokens=False)]
    rows, at = [], 0
    for name, ts in texts.items():
        bad = sum(a != b for a, b in zip(got["ids"][at : at + len(ts)], want[at : at + len(ts)]))
        check = f"Engine.tokenize ids == tokenizers, {label}, {name} (validation)"
        rows.append(row(got["version"], check, f"{bad} of {len(ts)} differ", not bad))
        at += len(ts)
    return rows


def model(bundle: Path) -> Path:
    return bundle / json.loads((bundle / "manifest.json").read_text())["model"]


def default_rows(work: Path) -> list[dict]:
    """genai.build's spm model (executorch_pte.shared_model's, the same weights), exported to
    .litertlm at fp32 and int4."""
    from tokenizers import Tokenizer

    from benchmarks.runtimes.executorch_pte import once, shared_model
    from benchmarks.runtimes.genai import CHATS, doel_side, validation_lines
    from doel.export.litertlm import export_litertlm

    bundles, ckpt = shared_model(work)
    lt = {}
    for q in ("fp32", "int4"):
        lt[q] = work / f"litertlm-{q}"
        once(lt[q], lambda q=q: export_litertlm(ckpt, lt[q], q, force=True, max_seq_len=256))
    lines = validation_lines()
    rows = tokenizer_rows(lt["fp32"], lines, work, "default (spm)", ckpt / "tokenizer.json")
    version = rows[0]["version"]
    prompt_text = [ls[i][:80] for ls in lines.values() for i in range(4)]
    ref = doel_side(bundles["fp32"], prompt_text, [])
    tok = Tokenizer.from_file(str(lt["fp32"] / "tokenizer.json"))
    for q in ("fp32", "int4"):
        side = doel_side(bundles[q], [], ref["ids"])
        spec = {"bundle": str(model(lt[q])), "seq": 256, "prompts": prompt_text, "new": NEW}
        spec["fp32"] = q == "fp32"
        spec |= {"chats": CHATS} if q == "fp32" else {}
        got = run_probe(spec, work)
        # LiteRT-LM decodes a reply alone, as tokenizers' decode does (the spm decoder's Strip
        # takes the first space); doel-serve's stream keeps it, the prompt being its context
        texts = [tok.decode(g) for g in side["gen"]]
        made = [(g["text"], t) for g, t in zip(got["gen"], texts) if "\ufffd" not in t]
        bad = sum(a != b for a, b in made)
        check = (
            f"greedy text == tokenizers' decode of doel-serve's greedy ids, {q} (.litertlm {q} "
            f"vs ONNX {q}, valid UTF-8)"
        )
        rows.append(row(version, check, f"{bad} of {len(made)} differ", not bad))
        if q != "fp32":
            continue
        stops = json.loads((lt[q] / "manifest.json").read_text())["litertlm"]["stop_ids"]
        check = "bundle's stop tokens (Engine.eos_token_ids) == doel-serve's (EOS, end of turn)"
        rows.append(row(version, check, f"{got['stops']} vs {stops}", got["stops"] == stops))
        start = tok.id_to_token(got["start"]) if got["start"] is not None else ""
        bad = sum(start + a != b for a, b in zip(got["chat"], ref["chat"]))
        check = "minja's render of the bundle's chat template (+ its start token) == doel-serve's"
        rows.append(row(version, check, f"{bad} of {len(CHATS)} differ", not bad))
    return rows


def not_installed(work: Path) -> list[dict]:
    """[] where LiteRT-LM's venv is there (and `work` made), else the one row saying what to do."""
    from doel.export.common import ExportError
    from doel.export.phone import runtime_python

    work.mkdir(parents=True, exist_ok=True)
    try:
        runtime_python("litertlm")
    except ExportError as e:
        return [row("?", "the runtime is installed", str(e).split(";")[0], False)]
    return []


def rows(work: Path) -> list[dict]:
    return not_installed(work) or default_rows(work)


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        spec = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        Path(sys.argv[3]).write_text(json.dumps(probe(spec), ensure_ascii=False), "utf-8")
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
