"""Serve: sampling as pure numpy functions, and streamed text that never splits a UTF-8
character, a Bengali grapheme cluster or a stop string."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
import pytest

from doel.serve.core.sampling import SamplingParams, sample, top_p_probs
from doel.serve.core.textstream import TextStream, open_cluster_start

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


def _top_p_by_full_sort(probs: np.ndarray, p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    mass = np.cumsum(probs[order])
    keep = order[(mass - probs[order]) < p]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.mark.parametrize("seed", range(40))
def test_top_p_sorting_only_the_likeliest_equals_the_full_sort(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 5000))
    # Peaked, flat, and coarse (many exact ties) distributions; few candidates force widening.
    logits = rng.standard_normal(vocab) * rng.choice([0.1, 1.0, 8.0])
    if seed % 3 == 0:
        logits = np.round(logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    for p in (0.01, 0.5, 0.9, 0.999, rng.random()):
        for candidates in (1, 3, 256):
            got = top_p_probs(probs, p, candidates=candidates)
            assert np.array_equal(got, _top_p_by_full_sort(probs, p)), (p, candidates)


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


SAMPLE_BN = Path(__file__).resolve().parents[3] / "train" / "sample" / "bn.txt"


def _long_text(n_chars: int = 6000) -> str:
    """Bangla prose with an emoji every 300 characters (spelled with byte-fallback tokens)."""
    bn = SAMPLE_BN.read_text(encoding="utf-8")[:n_chars]
    return "🙂".join(bn[i : i + 300] for i in range(0, len(bn), 300))


def _counting(decode):
    """`decode` that records how many ids and characters each call handles."""
    calls: list[tuple[int, int]] = []

    def counted(ids):
        text = decode(ids)
        calls.append((len(ids), len(text)))
        return text

    return counted, calls


def test_per_token_work_does_not_grow_with_the_completion(tok):
    """Issue 15's reproduction, scaled: four stop strings at the 256-character cap whose
    beginnings run through the text (so tails are held back and searched), over a 2,000-token
    completion. The ids and characters decoded for token 2,000 are those for token 20 (the
    whole completion was decoded again each token), and the text held back, which is all that
    the search for stops reads, stays within a stop string's length."""
    text = _long_text()
    ids = tok.encode(text, add_special_tokens=False).ids[:2050]
    assert len(ids) == 2050
    stops = [text[k : k + 255] + "\x00" for k in (100, 1500, 3000, 4500)]  # never complete
    decode, calls = _counting(tok.decode)
    ts = TextStream(decode, stops, context=[0])
    per_token, held = [], []
    for i in ids:
        start = len(calls)
        ts.push(i)
        per_token.append(sum(n + c for n, c in calls[start:]))
        held.append(len(ts.held))
    early, late = per_token[10:30], per_token[1990:2010]
    assert max(late) <= 2 * max(early) and sum(late) <= 1.5 * sum(early), (early, late)
    assert 200 < max(held) <= 256 + 64, max(held)  # a stop's beginning was held back, no more


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def test_a_long_completion_streams_the_whole_decode_and_cuts_at_the_first_stop(tok):
    """The incremental decoding gives exactly the whole decode (byte-fallback characters whole,
    nothing lost at window boundaries), and stops found 1,800 tokens in cut where a search of
    the whole text would."""
    text = _long_text()
    whole = tok.decode(tok.encode(text, add_special_tokens=False).ids[:2050])
    chunks, ts = _stream(tok, whole)
    assert "".join(chunks) == whole and not ts.stopped
    assert not any("\ufffd" in c for c in chunks)
    late = len(whole) * 9 // 10
    for stops in (
        ["never", whole[late : late + 256]],
        [whole[late + 40 : late + 45], whole[late : late + 200], "🙂"],
        [whole[late : late + 3] + "\x00", whole[late + 1 : late + 3]],
    ):
        cut = _first_stop(whole, stops)
        chunks, ts = _stream(tok, whole, stops)
        assert "".join(chunks) == whole[:cut] and ts.stopped, stops
