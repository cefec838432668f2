"""Bangla characters per second: the number a reader feels (issue 22, item 4).

Decode tokens/s is not comparable across tokenizers: a model whose tokenizer cuts Bangla into
byte pieces must decode several tokens for one character. So, on this machine, in one run:
- doel's 0.4B int4 bundle (bench_serve.py's random-weight model) on serve/core/engine.py, and
- llama.cpp (llama-cpp-python) on a Qwen2.5-0.5B-shaped model with random weights at q4_0
  (896 wide, 24 layers, 14/2 heads, MLP 4,864, the 151,936-token vocabulary, tied head: its
  published shape), written here with the gguf package and the Qwen2 vocabulary that llama.cpp
  ships for its tokenizer tests (../shared/data/tokenizers/llamacpp_vocab_gguf),
each decode greedily after a 128-token prompt in its own process (bench_serve_engines.py), and
their tokens/s are multiplied by their tokenizer's Bangla characters per token on the
validation split of ../shared/data/splits.json (Bengali-script runs, train/data/fertility.py):
Qwen2's measured here through llama.cpp's own tokenizer, doel's from the tokenizer benchmark
(benchmarks/results/tokenizer.json, the 32,768-token tokenizer trained on the train split).
Random weights: speed does not depend on them.

Run it with priority where other jobs share the machine (a scheduler autogroup at nice -20:
`setsid bash -c 'echo -20 > /proc/self/autogroup; python -m benchmarks.serve.bench_bangla_chars'`).
Writes benchmarks/results/bangla_chars_cpu-<class>.{json,md}. Run after bench_serve.py with
its `--work` folder kept, or alone (it builds the doel bundle: a few minutes).
"""

from __future__ import annotations

import ctypes
import json
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common.cpu_class import this_cpu
from benchmarks.common.report import SERVE_WORK_HELP, cpu_name, load_line, parser, publish
from benchmarks.serve.bench_serve import FULL, measured, setup
from benchmarks.serve.bench_serve_llama import THREADS, gguf_package, silenced
from benchmarks.train.bench_tokenizer import measure
from doel.train.data.fertility import AnyTokenizer
from doel.train.data.textio import iter_source, resolve_sources

RESULTS = ("bangla_chars_cpu-<class>",)

ROOT = Path(__file__).resolve().parents[2]

DATA = ROOT.parent / "shared" / "data"
QWEN_VOCAB = "tokenizers/llamacpp_vocab_gguf/ggml-vocab-qwen2.gguf"
# Qwen2.5-0.5B's published configuration (its config.json), the shape that matters for speed.
QWEN05 = {
    "hidden": 896,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "ffn": 4864,
    "vocab": 151936,
    "rope_theta": 1e6,
    "eps": 1e-6,
    "context": 32768,
}


def validation_texts(data: Path) -> dict[str, list[str]]:
    splits = json.loads((data / "splits.json").read_text())
    return {
        lang: [
            d
            for s in resolve_sources([str(data / p) for p in splits[lang]["validation"]])
            for d in iter_source(s)
        ]
        for lang in ("bn", "en")
    }


def llama_vocab_tokenizer(path: Path) -> AnyTokenizer:
    """llama.cpp's tokenizer on a vocabulary-only GGUF, as the fertility report reads one."""
    import llama_cpp

    with silenced():
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    n = llm.n_vocab()
    pieces = [llm.detokenize([i], special=False) for i in range(n)]
    partial = np.zeros(n, bool)
    for i, raw in enumerate(pieces):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            partial[i] = True
    # A byte-level BPE has no fallback ids; a piece that is part of a character is "partial".
    return AnyTokenizer(
        name=path.stem,
        vocab_size=n,
        encode_batch=lambda texts: [
            llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts
        ],
        fallback=np.zeros(n, bool),
        partial=partial,
    )


def qwen_shaped_gguf(vocab_gguf: Path, out: Path) -> Path:
    """A Qwen2.5-0.5B-shaped GGUF, random f16 weights, with the Qwen2 vocabulary, quantized to
    q4_0 by llama.cpp (its own choice of type for the tied embedding, as for any q4_0 file)."""
    import llama_cpp

    q4 = out / "qwen05-q4_0.gguf"
    if q4.is_file():
        return q4
    gguf = gguf_package()  # the converter's own gguf package
    GGUFReader, GGUFWriter, LlamaFileType = gguf.GGUFReader, gguf.GGUFWriter, gguf.LlamaFileType

    c, rng = QWEN05, np.random.default_rng(0)
    vocab = GGUFReader(str(vocab_gguf)).fields
    f16 = out / "qwen05-f16.gguf"
    w = GGUFWriter(str(f16), "qwen2")
    w.add_name("qwen2.5-0.5b-shaped, random weights")
    w.add_context_length(c["context"])
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(vocab["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(vocab["tokenizer.ggml.pre"].contents())
    w.add_token_list(vocab["tokenizer.ggml.tokens"].contents())
    w.add_token_types(vocab["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(vocab["tokenizer.ggml.merges"].contents())
    w.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"].contents())
    w.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"].contents())

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float16)

    h, kv = c["hidden"], c["kv_heads"] * c["hidden"] // c["heads"]
    w.add_tensor("token_embd.weight", mat(c["vocab"], h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(c["layers"]):
        b = f"blk.{i}."
        for name, rows, cols in (
            ("attn_q", h, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, h),
            ("ffn_gate", c["ffn"], h),
            ("ffn_up", c["ffn"], h),
            ("ffn_down", h, c["ffn"]),
        ):
            w.add_tensor(f"{b}{name}.weight", mat(rows, cols))
        for name, n in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):  # Qwen2's q/k/v biases
            w.add_tensor(f"{b}{name}.bias", np.zeros(n, np.float32))
        w.add_tensor(f"{b}attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"{b}ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, THREADS
    with silenced():
        failed = llama_cpp.llama_model_quantize(
            str(f16).encode(), str(q4).encode(), ctypes.byref(p)
        )
    f16.unlink()
    if failed:
        raise SystemExit(f"llama_model_quantize to q4_0 failed (code {failed})")
    return q4


def decode_rows(work: Path, bundle: Path, gguf: Path, new_tokens: int) -> dict:
    """Each engine alone in its own process, greedy after a 128-token prompt, best of 3."""
    spec = work / "chars-spec.json"
    prompt = np.random.default_rng(0).integers(300, 3000, 128).tolist()
    spec.write_text(
        json.dumps(
            {
                "threads": THREADS,
                "n_ctx": 2048,
                # bench_serve_engines times a short and a long prompt: here both are the same
                "prompts": {"short": prompt, "long": prompt},
                "new_tokens": new_tokens,
                "repeats": {"short": 3, "long": 1},
            }
        )
    )
    return {
        "doel int4": measured("doel", bundle, spec, work),
        "llama.cpp q4_0": measured("llama.cpp", gguf, spec, work),
        "llama.cpp q4_0, flash attn": measured("llama.cpp+fa", gguf, spec, work),
    }


def run(work: Path, data: Path) -> dict:
    _, bundles, _ = setup(work, FULL, with_llama=False)
    texts = validation_texts(data)
    qwen_tok = llama_vocab_tokenizer(data / QWEN_VOCAB)
    fert = {"Qwen2 (llama.cpp's tokenizer)": measure(qwen_tok, texts)}
    committed = json.loads((ROOT / "benchmarks/results/tokenizer.json").read_text())
    fert["doel (benchmarks/results/tokenizer.json)"] = committed["tokenizers"]["doel"]
    gguf = qwen_shaped_gguf(data / QWEN_VOCAB, work)
    rows = decode_rows(work, bundles["int4"], gguf, FULL["new_tokens"])
    return {
        "date": date.today().isoformat(),
        "cpu": this_cpu(),
        "threads": THREADS,
        "qwen_shape": QWEN05,
        "fertility": fert,
        "rows": rows,
    }


def chars_per_second(r: dict) -> list[dict]:
    """Each engine's decode tokens/s times its tokenizer's Bangla characters per token."""
    cpt = {
        "doel": next(v for k, v in r["fertility"].items() if k.startswith("doel")),
        "llama.cpp": next(v for k, v in r["fertility"].items() if k.startswith("Qwen2")),
    }
    out = []
    for name, row in r["rows"].items():
        if "error" in row:
            out.append({"engine": name, "error": row["error"]})
            continue
        bn = cpt["doel" if name.startswith("doel") else "llama.cpp"]["bn"]["chars_per_token"]
        tok_s = row["short"]["decode_tok_s"]
        out.append(
            {
                "engine": name,
                "decode_tok_s": tok_s,
                "bn_chars_per_token": bn,
                "bn_chars_per_s": tok_s * bn,
                "foreign_cpu_s": row["foreign_cpu_s"],
                "row_wall_s": row["row_wall_s"],
            }
        )
    return out


def markdown(r: dict) -> str:
    rows = r["table"]
    ok = [x for x in rows if "error" not in x]
    doel = next(x for x in ok if x["engine"].startswith("doel"))
    best = max(
        (x for x in ok if x["engine"].startswith("llama")), key=lambda x: x["bn_chars_per_s"]
    )
    lines = [
        f"# Bangla characters per second, {r['date']}",
        "",
        f"CPU: {cpu_name(r['cpu'])}; {r['threads']} threads; "
        "greedy decode after a 128-token prompt, best of 3, each engine in its own process. "
        "doel: the 0.4B preset (random weights) as an int4 bundle on serve/core/engine.py. "
        "llama.cpp: a "
        "Qwen2.5-0.5B-shaped model (random weights, its 151,936-token vocabulary, tied head) at "
        "q4_0. Characters per token: Bengali-script text of the validation split "
        "(`../shared/data/splits.json`). Made by `benchmarks/serve/bench_bangla_chars.py`.",
        "",
        f"Machine load: {r.get('machine_load', 'not noted')}.",
        "",
        "| engine | decode tok/s | Bangla chars/token | **Bangla chars/s** "
        "| foreign CPU s (of row s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for x in rows:
        if "error" in x:
            lines.append(f"| {x['engine']} | failed: {x['error'][:80]} | | | |")
            continue
        lines.append(
            f"| {x['engine']} | {x['decode_tok_s']:.1f} | {x['bn_chars_per_token']:.3f} | "
            f"**{x['bn_chars_per_s']:.0f}** | {x['foreign_cpu_s']:.0f} ({x['row_wall_s']:.0f}) |"
        )
    lines += [
        "",
        f"doel's 0.4B int4 writes **{doel['bn_chars_per_s'] / best['bn_chars_per_s']:.1f}×** the "
        f"Bangla characters per second of llama.cpp's best row here ({best['engine']}) at "
        f"{doel['decode_tok_s'] / best['decode_tok_s']:.2f}× its tokens/s: most of the gap is "
        "the tokenizer (benchmarks/results/tokenizer.md), the rest the smaller model. Foreign "
        "CPU: seconds other processes used during each row, of the row's wall seconds (the "
        "benchmark ran at the highest scheduling priority; see its docstring).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, work=SERVE_WORK_HELP)
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args(argv)
    data = Path(args.data)
    if not (data / QWEN_VOCAB).is_file():
        sys.exit(f"no {data / QWEN_VOCAB}: point --data at the shared data folder")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_chars_"))
    t0 = time.time()
    r = run(work, data)
    r["table"] = chars_per_second(r)
    r["wall_s"] = time.time() - t0
    r["machine_load"] = load_line("at the end (2 cores)")
    publish(args.out, f"bangla_chars_cpu-{r['cpu']['class']}", r, markdown(r))


if __name__ == "__main__":
    main()
