"""`doel-export --format litertlm`: the chat template as LiteRT-LM is given it (fast: it renders
as the original does on string contents and on LiteRT-LM's lists of parts), and a tiny model's
bundle read by LiteRT-LM 0.18.1 itself, in its own venv (slow; skipped in one line where the venv
cannot be had): its tokenizer's ids equal `tokenizers'` on the sample's lines and the NFC/NFD
corner cases, its stop tokens are EOS and the end of turn, and its minja renders doel-serve's
chat prompt. The LiteRT-LM side is benchmarks/runtimes/litertlm_bundle.py's `probe`."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from corners import CORNERS
from jinja2.sandbox import ImmutableSandboxedEnvironment

from doel.export.litertlm import litertlm_template

SAMPLE = Path(__file__).resolve().parents[2] / "train" / "sample"
CHATS = [
    [{"role": "system", "content": "তুমি একজন সাহায্যকারী।"}, {"role": "user", "content": "হ্যালো"}],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "হাই!"}],
]


def _parts(chat: list[dict]) -> list[dict]:
    return [m | {"content": [{"type": "text", "text": m["content"]}]} for m in chat]


@pytest.mark.parametrize("source", ["doel", "chatml"])
def test_the_template_renders_the_same_on_strings_and_on_parts(tokenizer_path, source):
    if source == "doel":
        config = Path(tokenizer_path).parent / "tokenizer_config.json"
        template = json.loads(config.read_text(encoding="utf-8"))["chat_template"]
    else:  # SmolLM2's form: messages[0]['content'] and message['content'] added to strings
        template = (
            "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        )
    env = ImmutableSandboxedEnvironment()
    original, rewritten = env.from_string(template), env.from_string(litertlm_template(template))
    for chat in CHATS:
        kw = {"add_generation_prompt": True, "bos_token": "<|bos|>", "tools": None}
        want = original.render(messages=chat, **kw)
        assert rewritten.render(messages=chat, **kw) == want
        assert rewritten.render(messages=_parts(chat), **kw) == want
    assert litertlm_template(None) is None


@pytest.fixture(scope="module")
def litertlm_bundle(tmp_path_factory, sample_paths, tiny_model_config) -> Path:
    """A random tiny Llama on an spm tokenizer of the sample, `doel-export --format litertlm`
    (int4, the default) once for this module."""
    from doel.export.common import ExportError
    from doel.export.phone import runtime_python

    try:
        runtime_python("litertlm")
    except ExportError as e:
        pytest.skip(str(e).split(";")[0])
    torch = pytest.importorskip("torch")
    from doel.export.cli import main
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer
    from doel.train.hf import save_model
    from doel.train.model import Llama

    work = tmp_path_factory.mktemp("litertlm")
    cfg = TokenizerConfig(vocab_size=2048, style="spm")
    tok = train_tokenizer(resolve_sources(sample_paths), cfg, work / "tok", progress=False)
    torch.manual_seed(0)
    ckpt = save_model(Llama(tiny_model_config), work / "ckpt", tokenizer=tok)
    main([str(ckpt), "--out", str(work / "lt"), "--format", "litertlm", "--max-seq-len", "96"])
    return work / "lt"


@pytest.mark.slow
def test_litertlms_own_tokenizer_stops_and_chat_prompt(litertlm_bundle, tmp_path):
    from tokenizers import Tokenizer

    from benchmarks.runtimes.litertlm_bundle import model, run_probe
    from doel.serve.core.template import ChatTemplate

    manifest = json.loads((litertlm_bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["kind"] == "litertlm" and manifest["litertlm"]["stop_ids"] == [1, 6]
    tok = Tokenizer.from_file(str(litertlm_bundle / "tokenizer.json"))
    texts = []
    for name in ("bn.txt", "en.txt"):
        lines = [ln for ln in (SAMPLE / name).read_text(encoding="utf-8").splitlines() if ln]
        texts += lines[:100]
    texts += CORNERS + [unicodedata.normalize("NFD", t) for t in CORNERS]
    spec = {"bundle": str(model(litertlm_bundle)), "seq": 96, "texts": texts, "chats": CHATS}
    spec |= {"prompts": [texts[0][:40]], "new": 8}
    got = run_probe(spec, tmp_path)
    want = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    bad = [t[:30] for t, a, b in zip(texts, got["ids"], want) if a != b]
    assert not bad, f"{len(bad)} of {len(texts)} differ, first {bad[:3]}"
    assert got["stops"] == [1, 6] and got["start"] == 0
    template = ChatTemplate.load(litertlm_bundle)
    assert ["<|bos|>" + r for r in got["chat"]] == [template.render(m) for m in CHATS]
    assert got["gen"][0]["text"] and got["gen"][0]["decode_tok_s"] > 0


@pytest.mark.slow
def test_litertlm_on_aarch64_under_qemu_reads_the_bundle_as_on_x86(litertlm_bundle, tmp_path):
    """PyPI's aarch64 wheel of litert-lm-api under qemu-user (check_arm64's cached root; skipped
    in one line where it is not built yet: building it downloads a Debian root and ~1 GB of
    wheels, a benchmark's work, not a test's): the same tokenizer ids and greedy text as on x86."""
    from benchmarks.checks.check_arm64 import CACHE, PYTHON, ArmError, aarch64_python
    from benchmarks.runtimes.litertlm_arm64 import WHEEL
    from benchmarks.runtimes.litertlm_bundle import model, run_probe

    if not (CACHE / "root" / "usr" / "bin" / PYTHON).is_file():
        pytest.skip(f"no aarch64 root in {CACHE}: `make check-arm64` builds it once")
    try:
        side = aarch64_python([WHEEL[0]], WHEEL[1], "cortex-a76")
    except ArmError as e:
        pytest.skip(str(e).splitlines()[0])
    texts = [ln for ln in (SAMPLE / "bn.txt").read_text(encoding="utf-8").splitlines() if ln][:20]
    texts += CORNERS + [unicodedata.normalize("NFD", t) for t in CORNERS]
    spec = {"bundle": str(model(litertlm_bundle)), "seq": 96, "texts": texts}
    spec |= {"prompts": [texts[0][:40]], "new": 8}
    (tmp_path / "x86").mkdir()
    (tmp_path / "arm").mkdir()
    x86 = run_probe(spec | {"cache_dir": str(tmp_path / "x86")}, tmp_path)
    arm = run_probe(spec | {"cache_dir": str(tmp_path / "arm")}, tmp_path, side)
    assert (x86["machine"], arm["machine"]) == ("x86_64", "aarch64")
    assert arm["ids"] == x86["ids"] and arm["stops"] == x86["stops"]
    assert arm["gen"][0]["text"] == x86["gen"][0]["text"]
