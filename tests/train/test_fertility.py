"""The fertility report: per-script ratios, byte fallback, the balance warning, any format."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from doel.train.data.fertility import (
    balance_warnings,
    fertility,
    format_report,
    load_any,
    script_runs,
)
from doel.train.data.textio import iter_documents, resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

MIXED = st.text(st.sampled_from(list("আমি ভাত খাই। I eat rice, 2024 ১৯৭১ Ωμέγα \n\t")))


@given(MIXED)
def test_script_runs_cover_every_character(text):
    for line in text.splitlines():
        runs = script_runs(line)
        assert "".join(r for _, r, _ in runs) == (line if line.strip() else "")
        assert all(s in ("bengali", "latin", "other") for s, _, _ in runs)


def test_runs_split_by_script():
    runs = script_runs("আমি ভাত খাই, I eat rice. আবার ১২টা")
    assert [(s, r) for s, r, _ in runs] == [
        ("bengali", "আমি ভাত খাই,"),
        ("latin", " I eat rice."),
        ("bengali", " আবার ১২টা"),
    ]
    assert [w for _, _, w in runs] == [3, 3, 2]


def texts(paths):
    return [d for p in paths for d in iter_documents(p)]


def test_ours_is_fair_and_the_gpt2_split_is_not(tmp_path, sample_paths, tokenizer_path):
    gpt2_style = train_tokenizer(
        resolve_sources(sample_paths),
        TokenizerConfig(vocab_size=2048, min_frequency=1, style="gpt2"),
        tmp_path,
        progress=False,
    )
    ours = fertility(load_any(tokenizer_path), texts(sample_paths))
    theirs = fertility(load_any(gpt2_style), texts(sample_paths))
    assert ours["bengali"]["chars_per_token"] > 1.5 * theirs["bengali"]["chars_per_token"]
    assert balance_warnings(ours) == []
    warn = balance_warnings(theirs)
    assert len(warn) == 1 and "Bangla (bengali)" in warn[0] and "under half" in warn[0]
    assert ours["bengali"]["byte_fallback_rate"] < 0.01
    for r in ours.values():
        assert r["bytes_per_token"] >= r["chars_per_token"]
        assert r["tokens_per_word"] == pytest.approx(1 / r["words_per_token"], rel=1e-9)
    assert "WARNING" in format_report("x", theirs)
    # The report shows tokens per word beside characters per token, for each script.
    head, *rows = format_report("x", ours).splitlines()[1:]
    col = head.split().index("tok/word")
    for row in rows:
        script = row.split()[0]
        assert float(row.split()[col]) == pytest.approx(ours[script]["tokens_per_word"], abs=5e-4)


def test_tiktoken_file_of_bare_bytes(tmp_path):
    path = tmp_path / "bytes.tiktoken"
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    r = fertility(load_any(path), ["abc def", "আমি"])
    assert r["latin"]["chars_per_token"] == 1.0 and r["latin"]["byte_fallback_rate"] == 0.0
    # Every Bengali character is three UTF-8 bytes, each a token of its own.
    assert r["bengali"]["chars_per_token"] == pytest.approx(1 / 3)
    assert r["bengali"]["byte_fallback_rate"] == 1.0


def test_sentencepiece_byte_fallback(tmp_path, sample_paths):
    import sentencepiece as spm

    spm.SentencePieceTrainer.Train(
        input=sample_paths[1],
        model_prefix=str(tmp_path / "en"),
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    r = fertility(load_any(tmp_path / "en.model"), texts(sample_paths))
    assert r["latin"]["byte_fallback_rate"] < 0.01  # it knows English characters
    # It saw only the few Bengali words in en.txt: most Bengali text falls back to bytes.
    assert r["bengali"]["byte_fallback_rate"] > 0.5


def test_wordpiece_unknowns_count_as_fallback(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\nআমি\nভাত\n")
    r = fertility(load_any(tmp_path / "vocab.txt"), ["আমি ভাত খাই"])
    assert r["bengali"]["tokens"] == 3
    assert r["bengali"]["byte_fallback_rate"] == pytest.approx(1 / 3)


def test_a_damaged_tokenizer_file_of_any_format_is_one_line_naming_it(tmp_path, tokenizer_path):
    from doel.train.common import DoelError

    full = tokenizer_path.read_bytes()
    ranks = b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256))
    damaged = {
        "tokenizer.json": full[: len(full) // 2],  # a copy cut short
        "broken.json": b'{"model": {"type": "BPE", "vocab": 3}}',  # JSON, not a tokenizer
        "tekken.json": b'{"vocab": [{"rank": 0}], "config": {"pattern": "."}}',
        "cut.tiktoken": ranks[:-3] + b"\nQQ",  # a last line without its rank
        "vocab.txt": b"[UNK]\n\xff\xfe\n",  # not UTF-8
    }
    for name, data in damaged.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DoelError) as e:
            load_any(tmp_path / name)
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / name}: cannot be read as a"), msg
        assert "truncated or damaged" in msg and "\n" not in msg
