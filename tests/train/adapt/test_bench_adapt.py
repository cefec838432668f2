"""benchmarks/train/bench_adapt.py's from-scratch arm (issue 55): its spm tokenizer and shards are
made of the same Bangla and English text as the adapted arm's, at the same shares, so that its
English figure is that of a tokenizer that saw English. On the built-in sample (hermetic: the
benchmark's text is ../shared/data's)."""

from __future__ import annotations

import json

from adapt.tiny_sources import SAMPLE

from benchmarks.train import bench_adapt as ba


def _lines(lang: str) -> list[str]:
    return [ln for ln in (SAMPLE / f"{lang}.txt").read_text("utf-8").splitlines() if ln.strip()]


def test_the_scratch_arm_s_tokenizer_and_shards_hold_both_languages_at_the_run_s_shares(
    tmp_path, monkeypatch
):
    bn, en = SAMPLE / "bn.txt", SAMPLE / "en.txt"
    monkeypatch.setattr(ba, "corpus", lambda work: (bn, en))
    monkeypatch.setattr(ba, "held_out", lambda chars=0: {"bn": _lines("bn"), "en": _lines("en")})
    monkeypatch.setattr(ba, "SPM_VOCAB", 1024)
    shards, info = ba.scratch_shards(tmp_path)
    assert info["weights"] == list(ba.WEIGHTS) == ["bn=2", "en=1"]
    assert info["vocab"] == 1024
    # English merges learned: a tokenizer of Bangla alone spells English about a character a token
    assert info["chars_per_token"]["en"] > 1.8 and info["chars_per_token"]["bn"] > 1.8
    meta = json.loads((shards / "meta.json").read_text(encoding="utf-8"))
    assert meta["tokenizer"]["path"] == str(tmp_path / "scratch" / "tokenizer" / "tokenizer.json")
    tok = json.loads((tmp_path / "scratch" / "tokenizer" / "tokenizer.json").read_text("utf-8"))
    assert any(p.startswith("▁") and p[1:].isascii() and len(p) > 4 for p in tok["model"]["vocab"])
    assert ba.scratch_shards(tmp_path)[0] == shards  # made once: a second call reuses them
