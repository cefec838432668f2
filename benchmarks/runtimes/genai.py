"""onnxruntime-genai (0.18.0 in its own venv, and 0.15.2, the export's builder pin, in doel's)
reads a bundle of doel's default tokenizer (spm) as doel does: its own `og.Tokenizer` gives
`tokenizers`' ids on every line of the shared validation split and on blocks of 20 lines,
`og.TokenizerStream` decodes a greedy generation to doel-serve's text, the Generator's greedy ids
equal doel-serve's on int4 and int8 bundles, and `apply_chat_template` renders doel-serve's chat
prompt. Also transformers' AutoTokenizer on the same lines. Every figure is the runtime's own
output (export/genai.py says what the bundle gives genai, and why).

Run alone: `python -m benchmarks.runtimes.genai` prints the rows as JSON. The part that runs
inside genai's venv is `probe` (this file run as a script, `probe IN.json OUT.json`): it imports
nothing of doel, only onnxruntime_genai.
"""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

RESULTS = ()  # the aggregator (bench_runtimes) writes runtimes.{json,md}; this module writes none
GENAI_VENV = Path.home() / ".cache" / "doel" / "ortgenai-venv" / "bin" / "python"
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
BLOCK = 20  # lines a block
NEW = 24  # tokens a greedy generation


def probe(spec: dict) -> dict:
    """In genai's venv: encode, stream-decode, generate greedily and render chat prompts."""
    import onnxruntime_genai as og

    model = og.Model(spec["bundle"])
    tok = og.Tokenizer(model)
    chats = spec.get("chat", [])
    out = {"version": og.__version__}
    out["chat"] = [tok.apply_chat_template(json.dumps(m, ensure_ascii=False)) for m in chats]
    # genai's default (add_special_tokens "false"): the template's text brings its <|bos|>.
    out["chat_ids"] = [tok.encode(t).tolist() for t in out["chat"]]
    out["plain"] = [tok.encode(t).tolist() for t in spec.get("plain", [])]
    tok.update_options(add_special_tokens="true")  # <|bos|> as tokenizer.json's post-processor
    out["ids"] = [tok.encode(t).tolist() for t in spec.get("texts", [])]
    out["gen"] = []
    for ids in spec.get("gen", []):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + NEW)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        out["gen"].append([int(i) for i in gen.get_sequence(0)[len(ids) :]])
    out["stream"] = []
    for ids in spec.get("stream", []):
        stream = tok.create_stream()
        out["stream"].append("".join(stream.decode(i) for i in ids))
    return out


def run_probe(python: Path, spec: dict, work: Path) -> dict:
    """`probe` in the interpreter `python` (genai's venv, or doel's for 0.15.2)."""
    src, dst = work / "genai-in.json", work / "genai-out.json"
    src.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    cmd = [str(python), str(Path(__file__).resolve()), "probe", str(src), str(dst)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1200)
    return json.loads(dst.read_text(encoding="utf-8"))


def validation_lines() -> dict[str, list[str]]:
    """The shared validation split, NFC, one non-empty line a text, by language."""
    splits = json.loads((SHARED / "splits.json").read_text(encoding="utf-8"))
    out = {}
    for lang in ("bn", "en"):
        lines = []
        for rel in splits[lang]["validation"]:
            for line in (SHARED / rel).read_text(encoding="utf-8").splitlines():
                if rel.endswith(".jsonl") and line.strip():
                    line = json.loads(line).get("text", "")
                if line.strip():
                    lines.append(unicodedata.normalize("NFC", line))
        out[lang] = lines
    return out


def blocks(lines: list[str]) -> list[str]:
    return ["\n".join(lines[i : i + BLOCK]) for i in range(0, len(lines), BLOCK)]


def build(work: Path) -> dict[str, Path]:
    """An spm tokenizer on the shared train split (its first 2 M characters) and a random
    4-layer Llama on it, exported at int4 and int8."""
    import torch

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    splits = json.loads((SHARED / "splits.json").read_text(encoding="utf-8"))
    train = work / "train.txt"
    text = []
    for lang in ("bn", "en"):
        chars = 0
        for rel in splits[lang]["train"]:
            if rel.endswith(".txt") and chars < 1_000_000:
                part = (SHARED / rel).read_text(encoding="utf-8")[: 1_000_000 - chars]
                text.append(part)
                chars += len(part)
    train.write_text("\n".join(text), encoding="utf-8")
    cfg = TokenizerConfig(vocab_size=8192, style="spm")
    tok = train_tokenizer(resolve_sources([str(train)]), cfg, work / "tok", progress=False)
    model = ModelConfig(vocab_size=8192, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    ckpt = save_model(Llama(model), work / "ckpt", tokenizer=tok)
    bundles = {}
    for q in ("int4", "int8"):
        opts = ExportOptions(quant=q, eval_tokens=64, force=True, log=lambda _m: None)
        export_checkpoint(ckpt, work / f"bundle-{q}", opts)
        bundles[q] = work / f"bundle-{q}"
    return bundles


CHATS = [
    [{"role": "user", "content": "বাংলার রাজধানী কোথায়?"}],
    [{"role": "system", "content": "তুমি একজন সাহায্যকারী।"}, {"role": "user", "content": "হ্যালো"}],
    [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "হাই! কেমন আছ?"},
        {"role": "user", "content": "ভালো, ধন্যবাদ।\n  আর তুমি?"},
    ],
    [{"role": "system", "content": "Be brief."}],
]


def doel_side(bundle: Path, texts: list[str], prompts: list[list[int]]) -> dict:
    """What doel reads: tokenizers' ids, doel-serve's greedy ids and text, its chat prompts."""
    from tokenizers import Tokenizer

    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams
    from doel.serve.core.template import ChatTemplate

    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    engine = Engine(read_bundle(bundle), threads=2)
    gen = [list(engine.generate(p, SamplingParams(max_tokens=NEW, temperature=0))) for p in prompts]
    chat = ChatTemplate.load(bundle)
    return {
        "ids": [e.ids for e in tok.encode_batch(texts)],
        "decoded": tok.decode_batch([e.ids for e in tok.encode_batch(texts)]),
        "gen": gen,
        "text": [serve_text(tok, p, g) for p, g in zip(prompts, gen)],
        "chat": [chat.render(m) for m in CHATS],
        "chat_ids": [chat.ids(m) for m in CHATS],
    }


def serve_text(tok, prompt: list[int], made: list[int]) -> str:
    """The text doel-serve streams for `made` after `prompt` (its TextStream, with the prompt's
    last ids as context, so a first token's space is kept as it is inside the whole text)."""
    from doel.contracts.decoding import CONTEXT_IDS
    from doel.serve.core.textstream import TextStream

    stream = TextStream(tok.decode, (), prompt[-CONTEXT_IDS:])
    return "".join(stream.push(i) for i in made) + stream.finish()


def _row(version: str, check: str, bad: int, total: int, runtime="onnxruntime-genai") -> dict:
    result = f"{bad} of {total} differ"
    return {"runtime": runtime, "version": version, "check": check, "result": result, "ok": not bad}


def _differ(a: list, b: list) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def genai_rows(python: Path, bundles: dict[str, Path], lines: dict, work: Path) -> list[dict]:
    rows, b4 = [], bundles["int4"]
    texts = {
        k: v for lang, ls in lines.items() for k, v in ((lang, ls), (f"{lang} blocks", blocks(ls)))
    }
    flat = [t for ts in texts.values() for t in ts]
    prompts_text = [ls[i][:80] for ls in lines.values() for i in range(4)]
    ref = doel_side(b4, flat + prompts_text, [])
    prompts = ref["ids"][len(flat) :]
    side = {q: doel_side(b, [], prompts) for q, b in bundles.items()}
    streams = side["int4"]["gen"] + ref["ids"][: len(flat)]  # the texts' ids, <|bos|> first
    got = run_probe(python, {"bundle": str(b4), "texts": flat, "stream": streams,
                             "gen": prompts, "chat": CHATS}, work)  # fmt: skip
    v, at = got["version"], 0
    for name, ts in texts.items():
        n = len(ts)
        rows.append(_row(v, f"og.Tokenizer ids == tokenizers, {name} (validation)",
                         _differ(got["ids"][at : at + n], ref["ids"][at : at + n]), n))  # fmt: skip
        at += n
    # A random model's greedy bytes may be no UTF-8 at all: doel-serve shows U+FFFD for them,
    # genai's stream holds them back for good. Counted apart.
    made = [(a, b) for a, b in zip(got["stream"], side["int4"]["text"]) if "\ufffd" not in b]
    rows.append(_row(v, "TokenizerStream text == doel-serve's (int4 greedy, valid UTF-8)",
                     sum(a != b for a, b in made), len(made)))  # fmt: skip
    n = len(prompts) - len(made)
    shown = f"{n} of {len(prompts)}: doel-serve shows U+FFFD, genai's stream nothing"
    check = "greedy output that is no UTF-8 (random model)"
    rows.append({"runtime": "onnxruntime-genai", "version": v, "check": check, "result": shown})
    rows[-1]["ok"] = True
    texts_back = [ref["decoded"][i] for i in range(len(flat))]
    rows.append(_row(v, "TokenizerStream text == tokenizers' decode, validation lines + blocks",
                     _differ(got["stream"][len(prompts) :], texts_back), len(flat)))  # fmt: skip
    bad4 = _differ(got["gen"], side["int4"]["gen"])
    rows.append(_row(v, "greedy ids == doel-serve's, int4", bad4, len(prompts)))
    g8 = run_probe(python, {"bundle": str(bundles["int8"]), "gen": prompts}, work)
    bad8 = _differ(g8["gen"], side["int8"]["gen"])
    rows.append(_row(v, "greedy ids == doel-serve's, int8", bad8, len(prompts)))
    rows.append(_row(v, "apply_chat_template == doel-serve's chat prompt",
                     _differ(got["chat"], ref["chat"]), len(CHATS)))  # fmt: skip
    rows.append(_row(v, "its ids (encode, genai's defaults) == doel-serve's chat prompt ids",
                     _differ(got["chat_ids"], ref["chat_ids"]), len(CHATS)))  # fmt: skip
    return rows


def transformers_row(bundle: Path, lines: dict) -> dict:
    import transformers
    from tokenizers import Tokenizer

    hf = transformers.AutoTokenizer.from_pretrained(bundle)
    tok = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    flat = [t for ls in lines.values() for t in (*ls, *blocks(ls))]
    want = [e.ids for e in tok.encode_batch(flat)]
    bad = _differ(hf(flat)["input_ids"], want)
    return _row(transformers.__version__, "AutoTokenizer ids == tokenizers, validation lines and "
                "blocks", bad, len(flat), runtime="transformers")  # fmt: skip


def rows(work: Path) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    bundles, lines = build(work), validation_lines()
    out = []
    for python in (GENAI_VENV, Path(sys.executable)):
        if python.exists():
            out += genai_rows(python, bundles, lines, work)
    return out + [transformers_row(bundles["int4"], lines)]


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        spec = json.loads(Path(sys.argv[2]).read_text(encoding="utf-8"))
        Path(sys.argv[3]).write_text(json.dumps(probe(spec), ensure_ascii=False), "utf-8")
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(rows(Path(tmp)), ensure_ascii=False, indent=1))
