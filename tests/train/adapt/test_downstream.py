"""Issue 55, point 4: a model made by `doel-train adapt` goes through everything downstream
unchanged. The tiny imported base (its GGUF: SmolLM's split, byte-level BPE, ChatML) is adapted
with the default tokenizer (extended, qwen35 split) and a few steps of pretraining and chat, then
exported as int8 and int4 ONNX bundles (int4 with its browser page), and as a GGUF; llama.cpp
(llama-cpp-python) and the page's own tokenizer library (tokenizers.js, the file the page ships,
run in Node) read its vocabulary as tokenizers does; doel-serve's /v1/chat/completions answers a
Bangla question with the prompt rendered in the base's ChatML, in the adapted vocabulary."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from adapt.tiny_sources import CHATML, SAMPLE
from tokenizers import Tokenizer

from doel.train.adapt.run import AdaptConfig, adapt
from doel.train.config import load_config

pytestmark = pytest.mark.slow  # an adaptation and four exports

TEXT = [str(SAMPLE / "bn.txt"), str(SAMPLE / "en.txt")]
QUESTION = "বাংলাদেশের রাজধানীর নাম কী?"
# the question, the sample's opening lines and the corners of a split regex (qwen35's (?i:'s))
LINES = [
    QUESTION,
    "I'LL we'Ve DON'T “উদ্ধৃতি” ‘কথা’ — শেষ… ৳১,২৩৪.৫০ 12345",
    "  two  spaces\tand\ttabs\r\nlines\n",
    "য় ড় ঢ় and decomposed য\u09bc, ক্\u200dষ ক্\u200cষ, emoji 😀🇧🇩",
] + [ln for p in TEXT for ln in Path(p).read_text("utf-8").splitlines() if ln.strip()][:40]


@pytest.fixture(scope="module")
def adapted(tiny_gguf, tmp_path_factory) -> dict:
    """The tiny base imported, adapted at its defaults (3 steps, then 2 of chat): its folders."""
    from doel.train.adapt.importing import import_model

    work = tmp_path_factory.mktemp("downstream")
    base = import_model(tiny_gguf(), work / "base", log=print)
    sets = ["new_tokens=40", "tokenizer_chars=200000", "prepare.max_val_overlap=1.0"]
    pretrain = {"steps": 3, "seq_len": 64, "batch_size": 2, "warmup_steps": 1, "eval_every": 0,
                "checkpoint_every": 0, "dtype": "float32", "device": "cpu"}  # fmt: skip
    chat = {"steps": 2, "seq_len": 128, "batch_size": 2, "dtype": "float32", "device": "cpu",
            "checkpoint_every": 0, "eval_every": 0}  # fmt: skip
    sets += [f"pretrain.{k}={v}" for k, v in pretrain.items()]
    sets += [f"chat.{k}={v}" for k, v in chat.items()]
    cfg = load_config(AdaptConfig, None, sets)
    assert (cfg.tokenizer, cfg.split) == ("extend", "qwen35")  # the default path
    chat_data = [str(SAMPLE / "chat.jsonl")]
    final = adapt(cfg, base, TEXT, work / "run", chat_data=chat_data, skip_verify=True)
    n_base = json.loads((base / "config.json").read_text())["vocab_size"]
    return {"base": base, "final": final, "work": work, "n_base": n_base}


@pytest.fixture(scope="module")
def int8_bundle(adapted) -> Path:
    from doel.export.bundle import ExportOptions, export_checkpoint

    out = adapted["work"] / "bundle-int8"
    export_checkpoint(adapted["final"], out, ExportOptions(quant="int8", eval_tokens=64,
                                                           log=lambda _m: None))  # fmt: skip
    return out


def _same_ids(tok: Tokenizer, encode) -> list[str]:
    """The lines whose ids differ between tokenizers and `encode`."""
    return [t for t in LINES if encode(t) != tok.encode(t).ids]


def test_the_adapted_model_exports_as_int8_int4_and_gguf_with_its_vocabulary(adapted, int8_bundle):
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.gguf import export_gguf

    final = adapted["final"]
    tok = Tokenizer.from_file(str(final / "tokenizer.json"))
    assert tok.get_vocab_size() > adapted["n_base"]  # the new Bangla tokens
    int4 = adapted["work"] / "bundle-int4"
    export_checkpoint(final, int4, ExportOptions(quant="int4", eval_tokens=64, log=lambda _m: None))
    for bundle in (int8_bundle, int4):
        manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
        assert manifest["special_tokens"]["end_of_turn"]["token"] == "<|im_end|>"
        side = json.loads((bundle / "tokenizer_config.json").read_text(encoding="utf-8"))
        assert side["chat_template"] == CHATML  # the base's, not doel's
        assert (bundle / "tokenizer.json").read_bytes() == (final / "tokenizer.json").read_bytes()
    result = export_gguf(final, adapted["work"] / "gguf", "q8_0", log=lambda _m: None)
    assert result["pre_tokenizer"] == "qwen35" and result["chat_template"] is True
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = next((adapted["work"] / "gguf").glob("*.gguf"))
    llm = llama_cpp.Llama(str(gguf), n_ctx=64, verbose=False)
    wrong = _same_ids(tok, lambda t: llm.tokenize(t.encode("utf-8"), add_bos=False, special=False))
    llm.close()
    assert not wrong, f"llama.cpp differs on {len(wrong)} of {len(LINES)} lines: {wrong[0]!r}"


def test_the_browser_page_of_the_adapted_model_reads_its_vocabulary_exactly(adapted):
    """The page's tokenizer library, the very file the page ships (tokenizers.js), in Node."""
    from doel.export import web
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.common import ExportError

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node: apt-get install nodejs (the page's tokenizer is checked in it)")
    try:
        web.runtime_modules(log=lambda _m: None)
    except ExportError as e:
        pytest.skip(str(e))
    out = adapted["work"] / "bundle-int4-web"
    opts = ExportOptions(quant="int4", web=True, eval_tokens=64, log=lambda _m: None)
    export_checkpoint(adapted["final"], out, opts)
    page = out / "web"
    spec = json.loads((page / "web.json").read_text(encoding="utf-8"))
    assert 2 in spec["stop_ids"]  # <|im_end|>, the base's end of a reply
    script = (
        "const m = {exports: {}}; new Function('module', 'exports', require('fs')"
        ".readFileSync(process.argv[1], 'utf8'))(m, m.exports);"
        "const read = (f) => JSON.parse(require('fs').readFileSync(f, 'utf8'));"
        "const tok = new m.exports.Tokenizer(read(process.argv[2]), read(process.argv[3]));"
        "const lines = read(process.argv[4]);"
        "console.log(JSON.stringify(lines.map((t) => tok.encode(t).ids)));"
    )
    lines = adapted["work"] / "lines.json"
    lines.write_text(json.dumps(LINES, ensure_ascii=False), encoding="utf-8")
    files = [page / "tokenizers.min.js", page / "tokenizer.json", page / "tokenizer_config.json"]
    done = subprocess.run([node, "-e", script, *map(str, files), str(lines)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = dict(zip(LINES, json.loads(done.stdout)))
    tok = Tokenizer.from_file(str(page / "tokenizer.json"))
    assert any(i >= adapted["n_base"] for i in got[QUESTION])  # the new tokens, read as such
    wrong = _same_ids(tok, got.get)
    assert not wrong, f"tokenizers.js differs on {len(wrong)} of {len(LINES)} lines: {wrong[0]!r}"


def test_doel_serve_answers_a_bangla_question_in_the_base_s_template(adapted, int8_bundle):
    from fastapi.testclient import TestClient

    from doel.export import chat
    from doel.serve.core.template import ChatTemplate
    from doel.serve.edge.app import create_app
    from doel.serve.settings import Settings

    msgs = [{"role": "user", "content": QUESTION}]
    template = ChatTemplate.load(int8_bundle)
    prompt = template.render(msgs)
    assert prompt == chat.render(CHATML, msgs, {}, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and "<|user|>" not in prompt
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    ids = template.ids(msgs)
    assert any(i >= adapted["n_base"] for i in ids)  # the question in the new Bangla tokens
    assert 2 in template.stop_ids  # <|im_end|> ends a reply
    with TestClient(create_app(Settings(bundle=str(int8_bundle), threads=1))) as c:
        for _ in range(600):
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8,
                                                     "temperature": 0})  # fmt: skip
            if r.status_code != 503:  # loading
                break
            time.sleep(0.1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and isinstance(
        choice["message"]["content"], str
    )
    assert "<|im_" not in choice["message"]["content"]
