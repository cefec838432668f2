"""Corpus readers: every format yields the same documents; bad input says what to do."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from doel.train.common import DoelError
from doel.train.data.textio import (
    MissingTextField,
    iter_documents,
    iter_source,
    resolve_sources,
    with_field_fix,
)

DOCS = ["প্রথম অনুচ্ছেদ।", "Second paragraph,\nwith two lines.", "তৃতীয়: third"]


def test_all_formats_give_the_same_documents(tmp_path):
    (tmp_path / "blocks.txt").write_text("\n\n".join(DOCS) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "a.parquet")
    for name in ("blocks.txt", "a.jsonl", "a.parquet"):
        assert list(iter_documents(str(tmp_path / name))) == DOCS


def test_txt_without_blank_lines_is_one_document_a_line(tmp_path):
    (tmp_path / "lines.txt").write_text("one\n  two  \n\nthree\n".replace("\n\n", "\n"))
    assert list(iter_documents(str(tmp_path / "lines.txt"))) == ["one", "two", "three"]


def test_custom_text_field(tmp_path):
    import pickle

    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x y"}) + "\n")
    pq.write_table(pa.table({"body": ["x y"]}), tmp_path / "c.parquet")
    for name in ("c.jsonl", "c.parquet"):
        assert list(iter_documents(str(tmp_path / name), "body")) == ["x y"]
        # The way tokenizer and prepare take another field (their configs' text_field).
        with pytest.raises(MissingTextField, match=r"no 'text' .*; .* --set text_field=NAME$"):
            list(iter_documents(str(tmp_path / name)))
    docs = with_field_fix(iter_documents(str(tmp_path / "c.jsonl")), "use --text-field NAME")
    with pytest.raises(DoelError, match=r"c.jsonl:1: no 'text' field \(found \['body'\]\); use"):
        list(docs)
    e = MissingTextField("c.jsonl:1: no 'text' field", "use --text-field NAME")
    assert str(pickle.loads(pickle.dumps(e))) == str(e)  # crosses a process whole


def test_invalid_utf8_names_file_and_offset(tmp_path):
    (tmp_path / "bad.txt").write_bytes("ভালো\n".encode() + b"ok \xff here\n")
    with pytest.raises(DoelError, match=r"bad.txt: invalid UTF-8 at byte 16 \(line 2\).*iconv"):
        list(iter_documents(str(tmp_path / "bad.txt")))


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(DoelError, match="no such file"):
        resolve_sources([str(tmp_path / "nope.txt")])
    (tmp_path / "bin.txt").write_bytes(b"abc\0def")
    with pytest.raises(DoelError, match="binary"):
        list(iter_documents(str(tmp_path / "bin.txt")))
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(DoelError, match="broken.jsonl:1: not valid JSON"):
        list(iter_documents(str(tmp_path / "broken.jsonl")))


def test_source_names_are_unique(tmp_path):
    for sub in ("x", "y"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "data.txt").write_text(f"{sub}\n")
    (tmp_path / "data.en").write_text("e\n")
    srcs = resolve_sources(
        [
            str(tmp_path / "x" / "data.txt"),
            str(tmp_path / "y" / "data.txt"),
            str(tmp_path / "data.en"),
        ]
    )
    assert len({s.name for s in srcs}) == 3
    folder = resolve_sources([str(tmp_path / "x")])[0]
    assert folder.name == "x" and list(iter_source(folder)) == ["x"]
