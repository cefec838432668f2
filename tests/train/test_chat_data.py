"""Conversation data for `doel-train sft`: reading and its one-line errors, the overlong policy,
doel's renderer against transformers' apply_chat_template, an older vocabulary's reserved ids
renamed to the turn markers, the loader's padded rows and the loss-mask check (a planted mask
that lets user tokens into the loss is caught)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from doel.train.checks.chat import check_loss_mask
from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.data.chat import (
    ChatData,
    ChatLoader,
    SFTConfig,
    chat_tokenizer,
    check_messages,
    load_chat_data,
    render,
    render_many,
    special_ids,
    turn_texts,
)
from doel.train.data.tokenizer import CHAT_TEMPLATE, CHAT_TOKENS, END, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "train" / "sample" / "chat.jsonl"


def cfg(*sets: str) -> SFTConfig:
    return load_config(SFTConfig, ROOT / "configs" / "tiny.toml", ["seq_len=128", *sets])


def sample() -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in CHAT.read_text(encoding="utf-8").splitlines()]


def test_the_sample_reads_whole_with_every_conversation_counted(tok):
    lines = []
    # The tool-use conversations are the longest: 640 tokens hold them all.
    long = cfg("seq_len=640", "model.max_position_embeddings=1024")
    train, held = load_chat_data([str(CHAT)], tok, long, log=lines.append)
    s = train.stats
    assert s["conversations"] == len(sample()) == len(train.ids) + len(held.ids)
    assert len(held.ids) == len(sample()) // 20  # every 20th held out
    assert s["truncated"] == s["dropped"] == 0 and s["sources"] == {"chat": len(sample())}
    roles = [m["role"] for conv in sample() for m in conv]
    assert {"system", "user", "assistant"} <= set(roles)
    assert any(len(c) > 3 for c in sample())  # multi-turn conversations are there
    assert f"{len(sample())} conversations" in lines[0] and "0 truncated" in lines[0]


@pytest.mark.parametrize(
    "line, said",
    [
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "message 1 is 'assistant'"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
            "message 2 is 'user' where 'assistant' is expected",
        ),
        ('{"messages": [{"role": "user", "content": "a"}]}', "last message is 'user'"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
            "message 2 has unknown role 'bot'",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, '
            '{"role": "assistant", "content": " "}]}',
            "message 2 (assistant) has empty content",
        ),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, '
            '{"role": "assistant", "content": "b"}]}',
            "message 2 is 'system'",
        ),
        ('{"messages": []}', "non-empty list"),
        ('{"text": "plain"}', "no 'messages' field (found ['text'])"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_malformed_conversation_is_named_by_file_and_line(tmp_path, tok, line, said):
    path = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'
    path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(DoelError) as e:
        load_chat_data([str(path)], tok, cfg(), log=lambda _: None)
    assert str(e.value).startswith(f"{path}:3: ") and said in str(e.value)
    assert "\n" not in str(e.value)


def test_skip_malformed_counts_them_and_plain_text_files_are_refused(tmp_path, tok):
    path = tmp_path / "mixed.jsonl"
    rows = [sample()[0], [{"role": "user", "content": "only a question"}], sample()[1]]
    path.write_text("\n".join(json.dumps({"messages": r}) for r in rows), encoding="utf-8")
    lines = []
    train, _ = load_chat_data([str(path)], tok, cfg("skip_malformed=true"), log=lines.append)
    assert len(train.ids) == 2 and train.stats["malformed"] == 1
    assert f"{path}:2: the last message is 'user'" in lines[0]
    (tmp_path / "notes.txt").write_text("hello\n", encoding="utf-8")
    with pytest.raises(DoelError, match=r"notes\.txt: chat data must be \.jsonl or \.parquet"):
        load_chat_data([str(tmp_path / "notes.txt")], tok, cfg(), log=lambda _: None)


def test_prompt_response_rows_from_parquet_with_a_row_filter(tmp_path, tok):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "inputs": ["নদীর নাম বলো।", "Name a river.", "x"],
            "targets": ["পদ্মা।", "The Padma.", "y"],
            "language_code": ["ben", "eng", "fra"],
        }
    )
    folder = tmp_path / "aya"
    folder.mkdir()
    pq.write_table(table, folder / "part.parquet")
    c = cfg("prompt_field=inputs", "response_field=targets", "keep_rows=language_code=ben")
    train, _ = load_chat_data([str(folder)], tok, c, log=lambda _: None)
    assert train.stats["filtered"] == 2 and len(train.ids) == 1
    want, _ = render(
        tok, [{"role": "user", "content": "নদীর নাম বলো।"}, {"role": "assistant", "content": "পদ্মা।"}]
    )
    assert np.array_equal(train.ids[0], want)


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, tok):
    long_reply = "নদী " * 200
    convs = [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": long_reply}],
        [{"role": "user", "content": "প্রশ্ন " * 200}, {"role": "assistant", "content": "b"}],
        sample()[0],
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in convs), encoding="utf-8")
    train, _ = load_chat_data([str(path)], tok, cfg(), log=lambda _: None)
    # The long reply is cut at the context; the long question leaves no reply inside it.
    assert (train.stats["truncated"], train.stats["dropped"], len(train.ids)) == (1, 1, 2)
    assert len(train.ids[0]) == 129 and train.masks[0][-1]
    train, _ = load_chat_data([str(path)], tok, cfg("overlong=drop"), log=lambda _: None)
    assert (train.stats["truncated"], train.stats["dropped"], len(train.ids)) == (0, 2, 1)


def _auto(folder: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _assert_renders_as_transformers(tok, folder: Path, conversations):
    auto = _auto(folder)
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == (
        CHAT_TEMPLATE
    )
    ids = special_ids(tok)
    for conv, (seq, mask) in zip(conversations, render_many(tok, conversations), strict=True):
        assert seq.tolist() == auto.apply_chat_template(conv, tokenize=True)
        prompt = auto.apply_chat_template(conv[:-1], tokenize=True, add_generation_prompt=True)
        assert seq[: len(prompt)].tolist() == prompt  # a reply is asked for with these ids
        # The loss mask: exactly each assistant turn's text (content, tool calls) and its <|end|>.
        replies = [text for role, text in turn_texts(conv) if role == "assistant"]
        want = [
            t for r in replies for t in (*tok.encode(r, add_special_tokens=False).ids, ids["end"])
        ]
        assert seq[mask].tolist() == want


def test_doels_renderer_gives_apply_chat_templates_ids_and_masks_the_replies(tokenizer_path, tok):
    convs = sample()
    multi = [c for c in convs if c[0]["role"] == "system" and len(c) >= 3]
    assert multi and any(len(c) > 3 for c in convs)
    _assert_renders_as_transformers(tok, tokenizer_path.parent, convs)


def test_an_older_vocabulary_gets_the_markers_renamed_and_the_template(tmp_path, tokenizer_path):
    data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    for i, name in enumerate(CHAT_TOKENS):  # as vocabularies made before chat named them
        entry = next(a for a in data["added_tokens"] if a["id"] == 3 + i)
        entry["content"] = f"<|reserved_{i}|>"
        data["model"]["vocab"][f"<|reserved_{i}|>"] = data["model"]["vocab"].pop(name)
    old = tmp_path / "old"
    old.mkdir()
    (old / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DoelError, match="lacks"):
        special_ids(load_tokenizer(old))
    lines = []
    path = chat_tokenizer(old, tmp_path / "run", log=lines.append)
    assert "predates the chat markers" in lines[0]
    new = load_tokenizer(path)
    assert [new.token_to_id(t) for t in CHAT_TOKENS] == [3, 4, 5, 6]
    assert new.get_vocab_size() == load_tokenizer(tokenizer_path).get_vocab_size()
    _assert_renders_as_transformers(new, path.parent, sample()[:6])

    data["added_tokens"][4]["content"] = "<|tool|>"  # neither the markers nor the reserved
    (old / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DoelError, match="ids 3-6 are"):
        chat_tokenizer(old, tmp_path / "run2")


def _loader(tok, masks=None, n=12, seq_len=96) -> ChatLoader:
    pairs = render_many(tok, sample()[:n])
    data = ChatData([s for s, _ in pairs], masks or [m for _, m in pairs])
    return ChatLoader(data, 4, seq_len, 0, special_ids(tok))


def test_padded_rows_hold_one_conversation_each_and_resume_exactly(tok):
    loader = _loader(tok)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 96)
    pad = special_ids(tok)["pad"]
    for row_x, row_y in zip(x, y):
        n = int((row_x != pad).sum())
        assert (row_x[n:] == pad).all() and (row_y[n - 1 :] == -100).all()
        assert row_x[0] == special_ids(tok)["bos"] and row_y[-1] == -100
    state = loader.state_dict()
    after = [loader.next_batch() for _ in range(4)]  # across an epoch boundary (12 rows)
    again = _loader(tok)
    again.load_state_dict(state)
    assert all(
        np.array_equal(a[0], b[0]) for a, b in zip(after, [again.next_batch() for _ in range(4)])
    )
    with pytest.raises(DoelError, match="conversations=12"):
        _loader(tok, n=11).load_state_dict(state)


def test_the_loss_mask_check_passes_real_batches_and_catches_planted_masks(tok):
    setup = types.SimpleNamespace(loader=_loader(tok))
    ok = check_loss_mask(setup)
    assert ok.passed and ok.numbers["targets"] == ok.numbers["assistant_tokens"] > 0

    pairs = render_many(tok, sample()[:12])
    user = special_ids(tok)["user"]

    def with_user_tokens(seq, mask):  # the user's message learnt too
        planted = mask.copy()
        at = int(np.flatnonzero(seq == user)[0])
        planted[at + 1 : at + 3] = True
        return planted

    planted = [with_user_tokens(s, m) for s, m in pairs]
    bad = check_loss_mask(types.SimpleNamespace(loader=_loader(tok, planted)))
    assert bad.passed is False and "outside the assistant's spans" in bad.detail
    assert bad.numbers["extra_problems"] > 0

    end = special_ids(tok)["end"]
    no_end = [m & (s != end) for s, m in pairs]  # replies learnt, but never to stop
    bad = check_loss_mask(types.SimpleNamespace(loader=_loader(tok, no_end)))
    assert bad.passed is False and "assistant token without a target" in bad.detail
    none = check_loss_mask(types.SimpleNamespace(loader=object()))
    assert none.passed is None


def test_check_messages_keeps_only_role_and_content():
    got = check_messages(
        [{"role": "user", "content": "a", "id": 1}, {"role": "assistant", "content": "b"}], "x"
    )
    assert got == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert END == "<|end|>"
