"""train/evals/heldout.py: held-out bits per character against brute force, chunking, the random
twin, the compressors, the causal-leak check (and that it catches a leaky model), the label
shift, continuations and the checkpoint report. Tiny models only: the file runs in seconds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from doel.train.evals import heldout as ev
from doel.train.evals.generate import DEFAULT_PROMPTS
from doel.train.model import IGNORE_INDEX, Llama, ModelConfig


def tiny(vocab: int, hidden: int = 32, seed: int = 0, max_pos: int = 256) -> Llama:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
    )
    return Llama(cfg)


def trained_like(model: Llama, scale: float = 1.0) -> Llama:
    """Spread the weights so the model makes confident, context-dependent predictions: at the
    default 0.02 init every distribution is nearly uniform and would hide mistakes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, scale / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module")
def model(tok):
    return trained_like(tiny(tok.get_vocab_size(), hidden=48))


def brute_force_nats(model: Llama, ids: list[int]) -> float:
    """-log p(ids[j] | ids[:j]) summed over j >= 1, one forward pass per prefix."""
    total = 0.0
    with torch.no_grad():
        for j in range(1, len(ids)):
            logits = model(torch.tensor([ids[:j]]))[0, -1].float()
            total -= float(F.log_softmax(logits, -1)[ids[j]])
    return total


def test_bits_per_char_equals_brute_force(model, tok):
    text = "আমাদের গ্রামের নাম নদীপাড়া। The river is slow."
    ids = tok.encode(text).ids
    assert ids[0] == 0  # <|bos|>
    model.train()
    r = ev.bits_per_char(model, tok, [text], seq_len=64)
    assert model.training  # training mode restored
    expected = brute_force_nats(model, ids)
    assert r["tokens"] == len(ids) - 1 and r["documents"] == 1
    assert r["chars"] == len(text) and r["chars"] < len(text.encode())
    assert r["nats_per_token"] * r["tokens"] == pytest.approx(expected, rel=1e-5)
    assert r["bits_per_char"] == pytest.approx(expected / math.log(2) / len(text), rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(
        expected / math.log(2) / len(text.encode()), rel=1e-5
    )


def test_nfc_characters_are_counted(model, tok):
    decomposed = "e\u0301"  # é as two code points; NFC makes it one character
    assert ev.bits_per_char(model, tok, [decomposed], seq_len=16)["chars"] == 1


def test_chunks_score_every_token_once(model, tok, sample_paths):
    doc = " ".join(ev.read_texts(sample_paths[:1]))[:600]
    ids = tok.encode(doc).ids
    n = len(ids)
    assert n > 40
    wins = ev.windows(ids, 16)
    assert all(len(w) <= 17 for w in wins)
    targets = [t for w in wins for t in w[1:]]
    assert targets == ids[1:]  # every token after the <|bos|> exactly once, in order

    # Chunked scoring is the sum of scoring each chunk on its own (no context crosses a chunk
    # boundary beyond the shared token), whatever the batch size or padding.
    chunked, tokens = ev.score_ids(model, [ids], seq_len=16, batch_size=3)
    alone = sum(ev.score_ids(model, [w], seq_len=len(w))[0] for w in wins)
    assert tokens == n - 1
    assert chunked == pytest.approx(alone, rel=1e-5)

    # One window: the same as brute force over the whole document (full context).
    whole, tokens = ev.score_ids(model, [ids], seq_len=n)
    assert tokens == n - 1
    assert whole == pytest.approx(brute_force_nats(model, ids), rel=1e-5)
    assert ev.score_ids(model, [ids], seq_len=n + 50)[0] == pytest.approx(whole, rel=1e-6)


def test_padding_and_batching_change_nothing(model, tok, sample_paths):
    texts = ev.read_texts(sample_paths, max_chars=3000)
    one = ev.bits_per_char(model, tok, texts, seq_len=32, batch_size=1)
    many = ev.bits_per_char(model, tok, texts, seq_len=32, batch_size=7)
    assert one["tokens"] == many["tokens"]
    assert one["nats_per_token"] == pytest.approx(many["nats_per_token"], rel=1e-5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ev.bits_per_char(model, tok, texts, seq_len=10_000)


def test_random_twin_is_near_ln_vocab(model, tok, sample_paths):
    twin = ev.random_twin(model, seed=0)
    assert twin.config == model.config
    assert torch.equal(twin.lm_head.weight, ev.random_twin(model, seed=0).lm_head.weight)
    assert not torch.equal(twin.lm_head.weight, model.lm_head.weight)
    texts = ev.read_texts(sample_paths, max_chars=4000)
    r = ev.bits_per_char(twin, tok, texts, seq_len=64)
    ln_v = math.log(model.config.vocab_size)
    assert r["nats_per_token"] == pytest.approx(ln_v, rel=0.1)


def test_compressors_in_a_sane_range(sample_paths):
    texts = ev.read_texts(sample_paths)
    r = ev.compressor_bits_per_char(texts)
    assert set(r) == {"xz -9e", "bzip2 -9"}
    assert all(0.5 < v < 8 for v in r.values()), r


def test_language_guess(sample_paths, tmp_path):
    bn, en = sample_paths
    assert ev.guess_language(bn) == "bn" and ev.guess_language(en) == "en"
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("OK ১২৩ — আমার সোনার বাংলা, আমি তোমায় ভালোবাসি\n", encoding="utf-8")
    assert ev.guess_language(str(mixed)) == "bn"
    assert ev.group_by_language([en, bn, str(mixed)]) == {"en": [en], "bn": [bn, str(mixed)]}


class Leaky(nn.Module):
    """A model that sees one token into the future: position t reads token t + 1."""

    def __init__(self, inner: Llama):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(torch.roll(idx, -1, dims=1))


def test_causal_leak_passes_a_causal_model_and_catches_a_leaky_one():
    model = trained_like(tiny(64))
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    assert ev.causal_leak(model, idx) < 1e-5
    assert ev.causal_leak(Leaky(model), idx) > 1e-2


def test_label_shift_copy_task_reaches_zero_loss():
    """Pairs a a b b c c ...: the second of each pair is its predecessor, the first is random.
    With targets[t] = inputs[t + 1] and only the predictable targets kept, a correctly shifted
    model reaches ~0 loss; one that shifts again (or not at all) stays near ln V."""
    vocab, gen = 16, torch.Generator().manual_seed(0)
    model = tiny(vocab, hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def batch(n=32, pairs=8):
        seq = torch.randint(0, vocab, (n, pairs), generator=gen).repeat_interleave(2, dim=1)
        x, y = seq[:, :-1], seq[:, 1:].clone()
        y[:, 1::2] = IGNORE_INDEX  # those targets start a new pair: unpredictable
        return x, y

    for _ in range(60):
        x, y = batch()
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = batch(n=64)
    with torch.no_grad():
        assert float(model(x, y)) < 0.1
        # heldout.py's own shift (position t predicts token t + 1) agrees.
        lp = ev.token_logprobs(model, x)[:, :-1]
        nll = -lp.gather(-1, x[:, 1:, None])[..., 0]
        assert float(nll[:, 0::2].mean()) < 0.1  # the copies
        assert float(nll[:, 1::2].mean()) > 1.0  # the fresh random tokens


def test_continuations_are_deterministic(tok):
    model = trained_like(tiny(tok.get_vocab_size()))
    a = ev.continuations(model, tok, ["আমাদের গ্রামের", "The river"], max_new_tokens=8, seed=3)
    b = ev.continuations(model, tok, ["আমাদের গ্রামের", "The river"], max_new_tokens=8, seed=3)
    assert a == b and [s["prompt"] for s in a] == ["আমাদের গ্রামের", "The river"]
    assert all(s["greedy"] and s["sampled"] for s in a)
    assert "<|" not in "".join(s["greedy"] + s["sampled"] for s in a)
    assert len(ev.continuations(model, tok, max_new_tokens=2)) == len(DEFAULT_PROMPTS)


def test_evaluate_checkpoint_and_report(tok, tokenizer_path, sample_paths, tmp_path):
    from doel.train.hf import save_model

    model = tiny(tok.get_vocab_size(), seed=1, max_pos=64)  # not the twin (seed 0)
    folder = save_model(model, tmp_path / "ckpt", tokenizer=tokenizer_path)
    r = ev.evaluate_checkpoint(
        folder, sample_paths, max_chars=2000, prompts=["The"], max_new_tokens=4
    )
    assert set(r["languages"]) == {"bn", "en"} and r["seq_len"] == 64
    for lang in ("bn", "en"):
        fig = r["languages"][lang]
        assert fig["model"]["nats_per_token"] == pytest.approx(math.log(r["vocab_size"]), rel=0.1)
        assert fig["twin"]["tokens"] == fig["model"]["tokens"] > 0
        assert fig["twin"]["nats_per_token"] != fig["model"]["nats_per_token"]
        assert 2000 <= fig["model"]["chars"] < 2000 + 2000  # stops after max_chars
    text = ev.format_eval(r)
    assert "| bn |" in text and "| en |" in text and "twin bits/char" in text
    assert "prompt:  The" in text
