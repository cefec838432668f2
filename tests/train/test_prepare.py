"""Token shards: invariants of the stream, the honest balance, dedup, the overlap check, and the
loader's determinism and exact resume."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from doel.train.common import DoelError
from doel.train.data.loader import TokenLoader
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.shards import HEADER_BYTES, ShardWriter, itemsize_for, open_shard, read_header


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_path, sample_paths):
    out = tmp_path_factory.mktemp("shards")
    meta = prepare(
        tokenizer_path,
        sample_paths,
        out,
        PrepareConfig(val_fraction=0.1, shard_tokens=3000),
        progress=False,
        log=quiet,
    )
    return out, meta


def documents_in(out, meta, split, tok):
    docs = []
    for s in meta["splits"][split]["shards"]:
        h, ids = open_shard(out / s["file"])
        assert ids[0] == h.bos_id  # a shard never starts mid-document
        starts = np.flatnonzero(ids == h.bos_id)
        assert len(starts) == h.n_docs == s["documents"]
        ends = np.flatnonzero(ids == h.eos_id)  # and every one ends with <|eos|>, only there
        assert h.version == 2 and list(ends + 1) == [*starts[1:], len(ids)]
        for a, b in zip(starts, [*starts[1:], len(ids)]):
            docs.append(tok.decode(ids[a + 1 : b - 1].tolist()))
    return docs


def test_stream_holds_every_document_once_each_after_bos(shards, tok, sample_paths):
    out, meta = shards
    from doel.train.data.textio import iter_documents

    original = [unicodedata.normalize("NFC", d) for p in sample_paths for d in iter_documents(p)]
    train, val = documents_in(out, meta, "train", tok), documents_in(out, meta, "val", tok)
    assert sorted(train + val) == sorted(original)  # nothing lost, nothing added
    assert not set(train) & set(val)
    assert len(meta["splits"]["train"]["shards"]) > 1  # shard_tokens=3000 forced a split
    total = sum(s["tokens"] for sp in meta["splits"].values() for s in sp["shards"])
    per_source = sum(s["tokens"] + 2 * s["documents"] for s in meta["sources"].values())
    assert total == per_source  # source tokens plus one <|bos|> and one <|eos|> per document


def test_meta_shows_characters_and_tokens_side_by_side(shards, tokenizer_path):
    out, meta = shards
    from doel.train.common import sha256_file

    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["tokenizer"]["sha256"] == sha256_file(tokenizer_path)
    assert meta["format"]["dtype"] == "uint16"
    src = meta["sources"]
    assert set(src) == {"bn", "en"}
    assert sum(s["char_share"] for s in src.values()) == pytest.approx(1)
    assert sum(s["token_share"] for s in src.values()) == pytest.approx(1)
    for s in src.values():
        assert s["characters"] == s["train_characters"] + s["val_characters"] > 0
        assert s["chars_per_token"] == pytest.approx(s["characters"] / s["tokens"])


def test_weights_are_shares_of_characters(tmp_path, tokenizer_path, sample_paths):
    meta = prepare(
        tokenizer_path, sample_paths, tmp_path, weights=["bn=3", "en=1"], progress=False, log=quiet
    )
    bn, en = meta["sources"]["bn"], meta["sources"]["en"]
    assert bn["requested_char_share"] == 0.75
    # Whole documents of a few hundred characters: the share lands within one document.
    assert bn["char_share"] == pytest.approx(0.75, abs=0.02)
    assert en["documents"] < 41  # English was downsampled to fit, nothing was repeated
    with pytest.raises(DoelError, match="no share for"):
        prepare(tokenizer_path, sample_paths, tmp_path, weights=["bn=1"], progress=False)
    with pytest.raises(DoelError, match="SOURCE one of"):
        prepare(tokenizer_path, sample_paths, tmp_path, weights=["xx=1", "en=1"], progress=False)


def test_exact_duplicates_are_dropped(tmp_path, tokenizer_path):
    (tmp_path / "d.txt").write_text("আমি ভাত খাই।\nএকটা অন্য কথা।\nআমি ভাত খাই।\n")
    meta = prepare(
        tokenizer_path, [str(tmp_path / "d.txt")], tmp_path / "o", progress=False, log=quiet
    )
    assert meta["sources"]["d"]["duplicates_dropped"] == 1
    assert meta["splits"]["train"]["documents"] == 2


def test_validation_text_in_train_fails_loudly(tmp_path, tokenizer_path, sample_paths):
    def with_val(name: str, text: str) -> dict:
        (tmp_path / name).write_text(text)
        return prepare(
            tokenizer_path,
            sample_paths,
            tmp_path / "o",
            val=[str(tmp_path / name)],
            progress=False,
            log=quiet,
        )

    lines = Path(sample_paths[0]).read_text(encoding="utf-8").splitlines()
    with pytest.raises(DoelError, match="validation text also sits in the training set"):
        with_val("val.txt", lines[3][:200] + " নতুন কথা\n" + "সম্পূর্ণ নতুন একটি বাক্য।\n")
    with pytest.raises(DoelError, match="1 validation documents appear there whole"):
        with_val("whole.txt", lines[5] + "\n")
    meta = with_val("clean.txt", "এই লেখাটি প্রশিক্ষণের কোথাও নেই, একেবারে নতুন।\n")
    assert meta["overlap"]["in_train"] == 0 and meta["splits"]["val"]["documents"] == 1


def test_bad_inputs_say_what_to_do(tmp_path, tokenizer_path, sample_paths):
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(DoelError, match="empty"):
        prepare(tokenizer_path, [str(tmp_path / "empty.txt")], tmp_path / "o", progress=False)
    with pytest.raises(DoelError, match="tokenizer not found.*doel-train tokenizer"):
        prepare(tmp_path / "none.json", sample_paths, tmp_path / "o", progress=False)
    with pytest.raises(DoelError, match="no such file"):
        prepare(tokenizer_path, [str(tmp_path / "missing.txt")], tmp_path / "o", progress=False)


def test_header_is_self_describing_and_checked(tmp_path):
    w = ShardWriter(tmp_path, "train", vocab_size=100_000, bos_id=0, shard_tokens=10)
    ids = np.array([0, 70_000, 99_999, 0, 5], dtype=np.int64)
    w.add(ids, np.array([3, 2]))
    [info] = w.close()
    h, tokens = open_shard(tmp_path / info["file"])
    assert (h.itemsize, h.n_tokens, h.n_docs, h.vocab_size) == (4, 5, 2, 100_000)
    assert tokens.tolist() == ids.tolist()  # ids above 65535 survive in uint32
    assert itemsize_for(65_536) == 2 and itemsize_for(65_537) == 4
    path = tmp_path / info["file"]
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(DoelError, match="truncated"):
        read_header(path)
    path.write_bytes(b"NOTDOEL!" + bytes(HEADER_BYTES))
    with pytest.raises(DoelError, match="not a doel token shard"):
        read_header(path)


def test_loader_is_deterministic_and_shifted(shards):
    out, _ = shards
    a = TokenLoader(out, batch_size=4, seq_len=32, seed=1)
    b = TokenLoader(out, batch_size=4, seq_len=32, seed=1)
    c = TokenLoader(out, batch_size=4, seq_len=32, seed=2)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert xa.shape == ya.shape == (4, 32)
    assert (xa == xb).all() and not (xa == c.next_batch()[0]).all()
    assert (xa[:, 1:] == ya[:, :-1]).all()


def test_loader_resumes_exactly_across_epochs(shards):
    out, _ = shards
    a = TokenLoader(out, batch_size=4, seq_len=64, seed=0)
    steps = a.n_windows // 4 + 3  # runs past the end of the first epoch
    for _ in range(steps // 2):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # the state is plain JSON
    rest = [a.next_batch()[0] for _ in range(steps)]
    b = TokenLoader(out, batch_size=4, seq_len=64, seed=0)
    b.load_state_dict(state)
    assert all((x == b.next_batch()[0]).all() for x in rest)
    assert a.epoch >= 1
    with pytest.raises(DoelError, match="seq_len"):
        TokenLoader(out, batch_size=4, seq_len=32, seed=0).load_state_dict(state)


def test_loader_refuses_another_tokenizer(shards, tmp_path, sample_paths):
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    out, _ = shards
    other = train_tokenizer(
        resolve_sources(sample_paths[:1]), TokenizerConfig(vocab_size=512), tmp_path, progress=False
    )
    with pytest.raises(DoelError, match="different tokenizer"):
        TokenLoader(out, batch_size=2, seq_len=16, tokenizer=other)
    with pytest.raises(DoelError, match="no meta.json"):
        TokenLoader(tmp_path, batch_size=2, seq_len=16)


def test_shards_hold_what_the_full_tokenizer_encodes(tmp_path, tokenizer_path, tok):
    # prepare encodes without the tokenizer's own NFC, which its Python NFC makes redundant:
    # the tokens must be those of the full tokenizer, for marks its old tables do not know
    # (U+09FE, the Bengali sandhi mark) and for marks in every order.
    import random

    from tokenizers import normalizers

    rng = random.Random(0)
    pieces = ["ক", "ড", "য", "ে", "া", "ৗ", "়", "্", "ঁ", "\u09fe", "\u200c", "e", "\u0301", " "]
    docs = ["ড়ে\u09fe া ক\u09fe়্", "য়ো কৌ ক\u09fe়্য"] + [
        "".join(rng.choices(pieces, k=40)) for _ in range(300)
    ]
    assert type(tok.normalizer) is normalizers.NFC
    for d in docs:
        nfc = unicodedata.normalize("NFC", d)
        assert tok.normalizer.normalize_str(nfc) == nfc
    data = tmp_path / "marks.txt"
    data.write_text("\n".join(docs) + "\n", encoding="utf-8")
    meta = prepare(tokenizer_path, [str(data)], tmp_path / "out", progress=False, log=quiet)
    _, ids = open_shard(tmp_path / "out" / meta["splits"]["train"]["shards"][0]["file"])
    seen, expected = set(), []
    for d in docs:
        nfc = unicodedata.normalize("NFC", d).strip()
        if nfc and nfc not in seen:
            seen.add(nfc)
            expected += [*tok.encode(nfc).ids, tok.token_to_id("<|eos|>")]
    assert ids.tolist() == expected
