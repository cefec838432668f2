"""Serve: sampling as pure numpy functions, and streamed text that never splits a UTF-8
character, a Bengali grapheme cluster or a stop string."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest

from serve.sampling import SamplingParams, sample, top_p_probs
from serve.textstream import TextStream, open_cluster_start

LOGITS = np.log(np.array([0.05, 0.5, 0.15, 0.3]))


def _draws(p: SamplingParams, n: int = 3000, logits=LOGITS) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.array([sample(logits, p, rng) for _ in range(n)])


def test_temperature_zero_and_top_k_one_are_argmax():
    assert set(_draws(SamplingParams(temperature=0), 50)) == {1}
    assert set(_draws(SamplingParams(top_k=1), 50)) == {1}


def test_draws_follow_the_distribution_and_top_k_cuts_it():
    freq = np.bincount(_draws(SamplingParams()), minlength=4) / 3000
    assert np.abs(freq - np.exp(LOGITS)).max() < 0.03
    assert set(_draws(SamplingParams(top_k=2), 500)) == {1, 3}


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = np.exp(LOGITS)
    assert np.flatnonzero(top_p_probs(probs, 0.75)).tolist() == [1, 3]
    assert np.flatnonzero(top_p_probs(probs, 0.81)).tolist() == [1, 2, 3]
    assert np.flatnonzero(top_p_probs(probs, 0.01)).tolist() == [1]
    assert set(_draws(SamplingParams(top_p=0.75), 500)) == {1, 3}


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(_draws(SamplingParams(temperature=0.3)), minlength=4)[1] / 3000
    hot = np.bincount(_draws(SamplingParams(temperature=3.0)), minlength=4)[1] / 3000
    assert cold > 0.8 and hot < 0.4


def test_same_seed_same_tokens():
    def run(seed):
        rng = np.random.default_rng(seed)
        return [sample(LOGITS, SamplingParams(seed=seed), rng) for _ in range(40)]

    assert run(5) == run(5) and run(5) != run(6)


def test_penalties_move_greedy_off_a_repeated_token():
    logits = np.array([1.0, 3.0, 2.0, -1.0])
    seen = np.array([1, 3])
    assert sample(logits, SamplingParams(temperature=0), None, seen, seen) == 1
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, rep, None, seen, seen) == 2  # 3 / 2 = 1.5 < 2
    pres = SamplingParams(temperature=0, presence_penalty=1.5)
    assert sample(logits, pres, None, seen, seen) == 2
    # A seen negative logit goes further down (-1 * 2 = -2 < -1.5), never up.
    assert sample(np.array([-1.0, -1.5]), rep, None, np.array([0]), None) == 1


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="top_p, repetition_penalty"):
        SamplingParams(top_p=0, repetition_penalty=0.001)


def test_tiny_temperatures_are_greedy_not_overflow():
    # Found by the fuzz test: logits / 5e-324 are inf, and softmax of inf is NaN.
    assert set(_draws(SamplingParams(temperature=5e-324), 20)) == {1}


@pytest.mark.parametrize(
    "text, held",
    [
        ("আমি", "মি"),  # ends in a vowel sign: may still take ঁ, so the cluster waits
        ("আম", "ম"),  # a consonant waits for its vowel sign or virama
        ("গ্", "গ্"),  # a virama waits for the consonant it joins
        ("এক গ্র", "গ্র"),  # the whole conjunct, not just its last consonant
        ("নদী।", ""),
        ("১২৩", ""),
        ("Hello", ""),
        ("", ""),
    ],
)
def test_the_open_bengali_cluster_is_held_back(text, held):
    assert text[open_cluster_start(text) :] == held


def _stream(tok, text: str, stops=()) -> tuple[list[str], TextStream]:
    ids = tok.encode(text, add_special_tokens=False).ids
    ts = TextStream(tok.decode, stops, context=[0])
    chunks = [ts.push(i) for i in ids]
    chunks.append(ts.finish())
    return chunks, ts


def test_streamed_bengali_never_splits_a_cluster_or_a_character(tok):
    text = "নদীর ধারে একটি ছোট গ্রাম ছিল। চাঁদ উঠল 🙂 ক্ষমা"
    chunks, _ = _stream(tok, text)
    assert "".join(chunks) == text
    sent = ""
    for c in chunks:
        sent += c
        assert "\ufffd" not in sent
        # Each cut is a cluster boundary of the whole text: what follows starts a new cluster.
        nxt = text[len(sent) : len(sent) + 1]
        assert not nxt or (unicodedata.category(nxt)[0] != "M" and not sent.endswith("\u09cd"))
    # The decoder really does cut inside clusters: ধারে arrives as ' ধ', 'ার', 'ে'.
    assert len([c for c in chunks if c]) < len(tok.encode(text, add_special_tokens=False).ids)


def test_a_stop_string_ends_the_text_and_is_never_sent(tok):
    chunks, ts = _stream(tok, "one two three four", stops=["thr", "zzz"])
    assert "".join(chunks) == "one two " and ts.stopped
    chunks, ts = _stream(tok, "one two th", stops=["three"])
    assert "".join(chunks) == "one two th" and not ts.stopped  # an unfinished stop is text
