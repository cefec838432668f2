"""A model someone else trained, as SmolLM2-135M-Instruct is shaped (a byte-level BPE that splits
digits first, ChatML, its template in chat_template.jinja beside tokenizer_config.json, EOS
<|im_end|>): its tokenizer is named for what it is, the GGUF export writes it as llama.cpp's
"smollm" (and GPT-2's as "gpt2") and keeps refusing a split llama.cpp lacks, and every format
carries the model's own chat template and end of turn. Tiny random models and tokenizers trained
on the sample; the real model's figures are in docs/export.md."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from doel.export import chat, genai, modelfile
from doel.export.checkpoint import inspect_checkpoint
from doel.export.common import ExportError
from doel.export.gguf import llama_cpp_pre_type

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2-135M-Instruct's template, as its GGUF and transformers' chat_template.jinja hold it
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "The quick brown fox didn't jump over 12345 lazy dogs; it's 3.14 o'clock.\n\n  Indented\tx",
    "আমার সোনার বাংলা, আমি তোমায় ভালোবাসি। ১২৩৪৫ টাকা",
    "mixed বাংলা and English, 漢字, émigré 🙂 ٣ ½  trailing  ",
]


def byte_level(sample_paths, pre: list, vocab_size: int = 512) -> dict:
    """A byte-level BPE trained on the sample with the pre-tokenizer steps `pre` (ByteLevel
    last), ChatML's specials first, as tokenizers writes it: its tokenizer.json as a dict."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre) if len(pre) > 1 else pre[0]
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(sample_paths, trainer)
    return json.loads(tok.to_str())


def smollm_style(sample_paths) -> dict:
    digits = pre_tokenizers.Digits(individual_digits=True)
    return byte_level(sample_paths, [digits, pre_tokenizers.ByteLevel(add_prefix_space=False)])


def stranger_folder(folder, tok: dict, tok_config: dict | None = None, template=CHATML):
    """A random tiny Llama saved by transformers, beside `tok` and ChatML side files; the
    template in chat_template.jinja, where transformers 4.57's save_pretrained puts it."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok["model"]["vocab"]), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=96, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    side = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    side |= tok_config or {}
    (folder / "tokenizer_config.json").write_text(json.dumps(side), encoding="utf-8")
    if template is not None:
        (folder / chat.TEMPLATE_FILE).write_text(template, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def smollm_tok(sample_paths) -> dict:
    return smollm_style(sample_paths)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory, smollm_tok):
    return stranger_folder(tmp_path_factory.mktemp("stranger"), smollm_tok)


# (b) the tokenizer's form, named rightly


def test_a_byte_level_bpe_is_named_so_and_genai_is_told_where_it_differs(smollm_tok, sample_paths):
    gpt2 = byte_level(sample_paths, [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert genai.form(gpt2) == genai.form(smollm_tok) == "byte-level"
    # GPT-2's form genai runs as tokenizers does; a Digits step onnxruntime-extensions skips
    # (measured on SmolLM2: " ٣" and " ½" came out merged).
    assert genai.not_exact(gpt2) is None
    assert genai.not_exact(smollm_tok) == genai.DIGITS_SKIPPED


def test_transformers_hybrid_and_doel_style_are_each_named_for_what_they_are(
    smollm_tok, tokenizer_path
):
    # transformers 4.57 rebuilds a GGUF's byte-level BPE with byte fallback and a decoder of
    # ByteFallback, Fuse, Replace and ByteLevel: not the doel style, and said so.
    hybrid = json.loads(json.dumps(smollm_tok))
    hybrid["model"]["byte_fallback"] = True
    hybrid["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }
    why = genai.not_exact(hybrid)
    assert genai.form(hybrid) == "other"
    assert "byte-level BPE with byte fallback" in why and "doel style" not in why
    doel = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    assert "doel style" in genai.not_exact(doel)


# (c) GGUF of a byte-level BPE


def test_llama_cpp_pre_types_are_found_for_gpt2_and_smollm_splits(
    smollm_tok, sample_paths, tmp_path
):
    gpt2 = byte_level(sample_paths, [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert llama_cpp_pre_type(gpt2, tmp_path) == "gpt2"
    assert llama_cpp_pre_type(smollm_tok, tmp_path) == "smollm"


def test_a_split_llama_cpp_lacks_is_refused_in_one_line(sample_paths, tmp_path):
    odd = pre_tokenizers.Split(Regex(r"\s+|[a-z]+"), behavior="isolated")
    tok = byte_level(
        sample_paths, [odd, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    with pytest.raises(ExportError) as e:
        llama_cpp_pre_type(tok, tmp_path / "tokenizer.json")
    assert "\n" not in str(e.value) and "none of llama.cpp's pre-tokenizers" in str(e.value)
    digits_after = [
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        pre_tokenizers.Digits(individual_digits=True),
    ]
    with pytest.raises(ExportError, match="not regex splits followed by byte-level"):
        llama_cpp_pre_type(byte_level(sample_paths, digits_after), tmp_path / "tokenizer.json")


def test_the_gguf_of_a_smollm_style_model_carries_its_tokenizer_template_and_stops(
    stranger, smollm_tok, tmp_path
):
    gguf = pytest.importorskip("gguf")
    from doel.export.gguf import export_gguf

    out = tmp_path / "g"
    result = export_gguf(stranger, out, "f32", log=lambda _m: None, verify=False)
    assert result["pre_tokenizer"] == "smollm" and result["chat_template"] is True
    f = gguf.GGUFReader(str(out / "model-f32.gguf")).fields

    def value(key):
        return f[key].contents()

    assert (value("tokenizer.ggml.model"), value("tokenizer.ggml.pre")) == ("gpt2", "smollm")
    vocab = smollm_tok["model"]["vocab"]
    assert value("tokenizer.ggml.tokens") == sorted(vocab, key=vocab.get)
    assert value("tokenizer.ggml.merges") == [" ".join(m) for m in smollm_tok["model"]["merges"]]
    assert value("tokenizer.ggml.token_type")[:3] == [3, 3, 3]  # the specials, control tokens
    assert value("tokenizer.chat_template") == CHATML  # read from chat_template.jinja
    assert value("tokenizer.ggml.eot_token_id") == value("tokenizer.ggml.eos_token_id") == 2
    assert not value("tokenizer.ggml.add_bos_token")  # its post-processor adds nothing


# (a) the chat template and the end of turn


def test_the_template_is_read_from_chat_template_jinja_and_its_turn_end_found(stranger):
    ckpt = inspect_checkpoint(stranger, verify=False)
    assert ckpt.chat_template == CHATML
    assert ckpt.special_tokens["end_of_turn"] == {"id": 2, "token": "<|im_end|>"}


def test_the_end_of_turn_is_what_a_template_writes_after_a_reply():
    from doel.train.data.tokenizer import CHAT_TEMPLATE

    llama3 = (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] + '<|eot_id|>' }}{% endfor %}"
    )
    specials = ["<|end|>", "<|eot_id|>", "<|im_end|>", "<|bos|>", "<|start_header_id|>"]
    config = {"bos_token": "<|bos|>"}
    assert chat.end_of_turn(CHATML, config, specials) == "<|im_end|>"
    assert chat.end_of_turn(CHAT_TEMPLATE, config, specials) == "<|end|>"
    assert chat.end_of_turn(llama3, config, specials) == "<|eot_id|>"
    assert chat.end_of_turn("{{ messages[0]['content'] }}", config, specials) is None
    assert chat.end_of_turn("{{ raise_exception('no') }}", config, specials) is None


def test_chatml_templates_are_recognised_by_what_they_render():
    from doel.train.data.tokenizer import CHAT_TEMPLATE

    plain = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with_tools = plain.replace("{% for", "{% if tools %}TOOLS{% endif %}{% for")
    assert modelfile.chatml_system(CHATML, {}) == SYSTEM
    assert modelfile.chatml_system(plain, {}) == ""
    assert modelfile.chatml_system(with_tools, {}) is None  # it renders tools; CHATML_GO does not
    assert modelfile.chatml_system(CHAT_TEMPLATE, {"bos_token": "<|bos|>"}) is None


def test_the_modelfile_gets_chatml_in_go_and_the_models_own_stops(stranger):
    text = modelfile.modelfile("m.gguf", inspect_checkpoint(stranger, verify=False))
    lines = text.splitlines()
    assert [x for x in lines if x.startswith("PARAMETER stop")] == ['PARAMETER stop "<|im_end|>"']
    assert "<|im_start|>{{ .Role }}" in text and json.dumps(SYSTEM) in text
    assert "<|end|>" not in text


def test_the_bundles_side_files_carry_the_template_and_the_models_eos(tmp_path, smollm_tok):
    # As transformers 4.57 writes a folder it loaded from SmolLM2's GGUF: tokenizer_config.json
    # names <|im_start|> as EOS, config.json's eos_token_id is <|im_end|>'s.
    from doel.export.bundle import hf_files

    folder = stranger_folder(tmp_path / "src", smollm_tok, {"eos_token": "<|im_start|>"})
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    out, notes = tmp_path / "stage", []
    out.mkdir()
    hf_files(inspect_checkpoint(folder, verify=False), out, notes.append)
    side = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    special_map = json.loads((out / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert side["chat_template"] == CHATML
    assert side["eos_token"] == special_map["eos_token"] == "<|im_end|>"
    assert len(notes) == 2 and all("<|im_start|>" in n and "\n" not in n for n in notes)
    gen = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == 2


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, stranger):
    pytest.importorskip("onnxruntime_genai")
    from doel.export.bundle import ExportOptions, export_checkpoint

    out = tmp_path_factory.mktemp("stranger-bundle") / "b"
    opts = ExportOptions(quant="fp32", eval_tokens=64, verify=False, log=lambda _m: None)
    export_checkpoint(stranger, out, opts)
    return out


def test_doel_serve_chats_on_the_bundle_in_the_models_own_format(bundle):
    from fastapi.testclient import TestClient

    from doel.serve.core.template import ChatTemplate
    from doel.serve.edge.app import create_app
    from doel.serve.settings import Settings

    template = ChatTemplate.load(bundle)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert template.render(msgs) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
        "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert 2 in template.stop_ids  # <|im_end|> ends a reply
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["special_tokens"]["end_of_turn"]["token"] == "<|im_end|>"
    assert manifest["genai_tokenizer"]["form"] == "byte-level"
    with TestClient(create_app(Settings(bundle=str(bundle), threads=1))) as c:
        for _ in range(600):
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
            if r.status_code != 503:  # loading
                break
            time.sleep(0.1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(template.ids(msgs))


@pytest.mark.slow
def test_llama_server_tokenizes_the_smollm_gguf_as_tokenizers_and_renders_its_chat(
    stranger, smollm_tok, tmp_path
):
    from benchmarks.runtimes import llama_server

    if not llama_server.BINARY.is_file():
        pytest.skip("llama-server is not built: python -m benchmarks.load.bench_load "
                    "--install-llama-server")  # fmt: skip
    from doel.export.gguf import export_gguf

    export_gguf(stranger, tmp_path / "g", "f32", log=lambda _m: None, verify=False)
    tok = Tokenizer.from_str(json.dumps(smollm_tok))
    msgs = [{"role": "user", "content": "আমি ভাত খাই"}]
    gguf = tmp_path / "g" / "model-f32.gguf"
    with llama_server.LlamaServer(gguf, tmp_path / "ls.log") as s:
        for text in TEXTS:
            got = s.json("/tokenize", {"content": text, "add_special": False})["tokens"]
            assert got == tok.encode(text).ids, text
        assert s.applied({"messages": msgs}) == chat.render(
            CHATML, msgs, {}, add_generation_prompt=True
        )


@pytest.mark.slow
def test_ollamas_go_template_renders_the_chatml_prompt(stranger, tmp_path):
    from benchmarks.runtimes import ollama

    if ollama.go() is None:
        pytest.skip("Go is missing: apt-get install golang-go (Ollama's templates are Go)")
    path = tmp_path / "Modelfile"
    path.write_text(modelfile.modelfile("m.gguf", inspect_checkpoint(stranger, verify=False)))
    cases = [{"messages": m, "tools": t} for m, t in modelfile.PROBES]
    cases += [
        {"messages": [{"role": "system", "content": "ধীরে \"বলো\""},
                      {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                      {"role": "user", "content": "z"}], "tools": None},
    ]  # fmt: skip
    want = [chat.render(CHATML, c["messages"], {}, add_generation_prompt=True) for c in cases]
    assert ollama.go_render(path, cases, tmp_path) == want


def test_a_folder_without_chat_template_gets_none(tmp_path, smollm_tok):
    shutil.rmtree(tmp_path / "x", ignore_errors=True)
    folder = stranger_folder(tmp_path / "x", smollm_tok, template=None)
    ckpt = inspect_checkpoint(folder, verify=False)
    assert ckpt.chat_template is None and "end_of_turn" not in ckpt.special_tokens
    assert modelfile.ollama_template(ckpt) == modelfile.RAW_TEMPLATE
