"""train/evals/generate.py and the evaluation's progress bars: cached decoding gives the tokens
and logits of the full forward (greedy, sampled, batched, past the context where the window
slides), does linear work, and the bars show on a terminal only."""

from __future__ import annotations

import io
import math
import sys
from dataclasses import replace

import pytest
import torch

from doel.train.evals import heldout as ev
from doel.train.evals.generate import KVCache, continuations, forward_cached, generate
from doel.train.model import Llama, ModelConfig


@pytest.fixture(scope="module")
def model() -> Llama:
    """A random model with spread weights: confident, context-dependent predictions (at the
    0.02 init every distribution is nearly uniform and would hide a wrong position)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=24,
    )
    m = Llama(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return m


@pytest.mark.parametrize("prompt_len", [1, 5, 23, 30])  # 23 + 1 fills the context; 30 is past it
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, 20), (0.7, None)])
def test_cached_decoding_gives_the_tokens_of_the_full_forward(
    model, prompt_len, temperature, top_k
):
    idx = torch.randint(3, 300, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    want = model.generate(
        idx, 12, temperature, top_k, generator=torch.Generator().manual_seed(5)
    )  # the whole window again for every token
    got = generate(model, idx, 12, temperature, top_k, generator=torch.Generator().manual_seed(5))
    assert got.shape == (2, prompt_len + 12) and torch.equal(got, want)


def test_every_cached_step_has_the_logits_of_the_full_forward(model):
    idx = torch.randint(3, 300, (3, 24), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model, 3)
    with torch.no_grad():
        got = [forward_cached(model, idx[:, :6], cache)]
        got += [forward_cached(model, idx[:, t : t + 1], cache) for t in range(6, 24)]
        full = model(idx).float()  # (B, T, V)
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, full[:, 5 + k], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        forward_cached(model, idx[:, :1], cache)
    with pytest.raises(ValueError, match="one at a time"):
        forward_cached(model, idx[:, :2], _filled(model, idx))


def _filled(model, idx) -> KVCache:
    cache = KVCache(model, idx.size(0))
    with torch.no_grad():
        forward_cached(model, idx[:, :4], cache)
    return cache


def test_samples_embed_each_position_once(model, tok, monkeypatch):
    """The work is linear in the tokens: every position goes through the model once (the full
    forward of `Llama.generate` embeds the whole window again for each token)."""
    big = Llama(replace(model.config, vocab_size=tok.get_vocab_size()))
    seen = []
    big.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(a[0].numel()))
    prompts = ["The river", "আমাদের গ্রামের নাম"]
    continuations(big, tok, prompts, max_new_tokens=8)
    prompt_tokens = [len(tok.encode(p).ids) for p in prompts]
    # greedy and sampled for each prompt: its tokens, then one per new token but the last
    assert sum(seen) <= sum(2 * (n + 7) for n in prompt_tokens)
    assert 2 * len(prompts) <= len(seen) <= 2 * len(prompts) * 8


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bars_show_on_a_terminal_only(model, tok, tokenizer_path, sample_paths, tmp_path):
    from doel.train.hf import save_model

    cfg = replace(model.config, vocab_size=tok.get_vocab_size(), max_position_embeddings=64)
    folder = save_model(Llama(cfg), tmp_path / "m", tokenizer=tokenizer_path)
    kw = {"max_chars": 300, "prompts": ["The", "আমাদের"], "max_new_tokens": 3}
    for stream, progress, shown in [
        (Terminal(), True, True),
        (Terminal(), False, False),  # --quiet
        (io.StringIO(), True, False),  # a pipe or a log file
    ]:
        old, sys.stderr = sys.stderr, stream
        try:
            ev.evaluate_checkpoint(folder, sample_paths, progress=progress, **kw)
        finally:
            sys.stderr = old
        text = stream.getvalue()
        if shown:
            assert "held-out text" in text and "sample texts" in text
            assert "12/12" in text  # 2 prompts x (greedy, sampled) x 3 tokens, eos or not
            assert "<" in text  # tqdm's elapsed<remaining: the ETA
        else:
            assert text == ""


def test_doel_train_eval_quiet_shows_no_bar_on_a_terminal(
    model, tok, tokenizer_path, sample_paths, tmp_path, monkeypatch, capsys
):
    from doel.train.cli import main
    from doel.train.hf import save_model

    cfg = replace(model.config, vocab_size=tok.get_vocab_size(), max_position_embeddings=64)
    folder = save_model(Llama(cfg), tmp_path / "m", tokenizer=tokenizer_path)
    args = ["eval", str(folder), "--text", *sample_paths, "--max-chars", "300"]
    for extra, shown in (([], True), (["--quiet"], False)):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        main(args + extra)
        assert ("sample texts" in terminal.getvalue()) is shown
        assert "| bn |" in capsys.readouterr().out
