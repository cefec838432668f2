"""The tokenizer keeps Bengali words whole, round-trips every string, and loads in the
Hugging Face libraries unchanged."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.data.textio import resolve_sources
from doel.train.data.tokenizer import (
    ASSISTANT,
    BOS,
    CHAT_TOKENS,
    END,
    EOS,
    PAD,
    PATTERNS,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
    TokenizerConfig,
    load_tokenizer,
    train_tokenizer,
)

BENGALI = st.characters(min_codepoint=0x0980, max_codepoint=0x09FF, categories=("L", "M", "N"))
# Any assigned character (the Unicode version of this Python), surrogates excluded.
ANY = st.characters(blacklist_categories=("Cs", "Cn"))
WORDS = ["বিশ্ববিদ্যালয়ে", "ক্ষমা", "স্বাধীনতা", "রাষ্ট্র", "আকাঙ্ক্ষা", "দুঃখ", "চাঁদ", "উৎসবে", "কৃষক"]


def split_pieces(pattern: str, text: str) -> list[str]:
    return [p for p, _ in pre_tokenizers.Split(Regex(pattern), "isolated").pre_tokenize_str(text)]


def cut_before_mark(pieces: list[str]) -> bool:
    """True when some piece starts with a combining mark right after a letter or mark: a word
    cut at a vowel sign, virama or nukta."""
    for prev, cur in zip(pieces, pieces[1:]):
        if cur and prev and unicodedata.category(cur[0]).startswith("M"):
            if unicodedata.category(prev[-1])[0] in "LM":
                return True
    return False


@given(st.lists(st.text(BENGALI, min_size=1, max_size=8), min_size=1, max_size=6))
def test_no_bengali_word_is_cut_at_a_mark(words):
    text = unicodedata.normalize("NFC", " ".join(words))
    assert not cut_before_mark(split_pieces(PATTERNS["doel"], text))


def test_real_words_stay_whole_and_gpt2_split_cuts_them():
    for w in WORDS:
        w = unicodedata.normalize("NFC", w)
        assert split_pieces(PATTERNS["doel"], " " + w) == [" " + w]
        # The trap doel avoids: the GPT-2 letter class cuts the same word at its marks.
        assert cut_before_mark(split_pieces(PATTERNS["gpt2"], " " + w))


def test_zwj_and_zwnj_stay_inside_words(tok):
    for w in ["র\u200d্যাব", "কি\u200cন্তু"]:
        assert split_pieces(PATTERNS["doel"], " " + w) == [" " + w]
        assert tok.decode(tok.encode(w).ids) == w


@pytest.mark.parametrize("digits", ["1234567", "১২৩৪৫৬৭", "2024১৯৭১"])
def test_digits_split_in_groups_of_at_most_three(digits):
    pieces = split_pieces(PATTERNS["doel"], digits)
    assert "".join(pieces) == digits
    assert all(len(p) <= 3 for p in pieces)


def test_nfc_keeps_the_nukta(tok):
    # ড় (U+09DC) is a composition exclusion: NFC gives ড + nukta, and the nukta must survive.
    for composed, base in [("\u09dc", "\u09a1"), ("\u09dd", "\u09a2"), ("\u09df", "\u09af")]:
        out = tok.decode(tok.encode(f"পা{composed}া").ids)
        assert out == f"পা{base}\u09bc" + "া"
        assert tok.normalizer.normalize_str(composed) == base + "\u09bc"


def nfc(s: str) -> str:
    return unicodedata.normalize("NFC", s)


# doel applies Python's NFC before encoding (as prepare does): the tokenizers library's NFC
# tables predate Unicode 10 and leave e.g. U+09FE after U+09BC out of canonical order.
@settings(max_examples=300, deadline=None)
@given(st.text(ANY, max_size=60))
def test_roundtrip_any_unicode_string(tok, s):
    assert tok.decode(tok.encode(nfc(s)).ids) == nfc(s)


@settings(max_examples=300, deadline=None)
@given(st.text(st.one_of(BENGALI, st.sampled_from(" \u200c\u200d।,!?\n0123")), max_size=80))
def test_roundtrip_bangla_heavy_strings(tok, s):
    assert tok.decode(tok.encode(nfc(s)).ids) == nfc(s)


def test_the_libraries_own_nfc_is_stale_for_the_sandhi_mark(tok):
    # Why doel normalizes in Python first: if this starts passing, the workaround can go.
    s = "\u09fe\u09bc"
    assert tok.normalizer.normalize_str(s) != nfc(s)


def test_special_tokens(tok, tokenizer_path):
    from tokenizers import Tokenizer

    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(ids)
    assert tok.encode("চা").ids[0] == tok.token_to_id(BOS)  # every document starts with BOS
    assert tok.encode("চা", add_special_tokens=False).ids[0] != tok.token_to_id(BOS)
    # A document that spells "<|eos|>" gets text tokens, not the control token...
    assert tok.token_to_id(EOS) not in tok.encode(f"a{EOS}b").ids
    # ...while the file, loaded plainly (as transformers does), maps it to the special id.
    plain = Tokenizer.from_file(str(tokenizer_path))
    assert plain.encode(f"{EOS}").ids[1:] == [tok.token_to_id(EOS)]


def test_loads_unchanged_in_transformers(tokenizer_path, tok):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = "আমাদের গ্রামের নাম নদীপাড়া। The river is slow."
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path))
    auto = AutoTokenizer.from_pretrained(str(tokenizer_path.parent))
    assert fast(text)["input_ids"] == tok.encode(text).ids
    assert auto(text)["input_ids"] == tok.encode(text).ids
    assert list(auto(text)) == ["input_ids", "attention_mask"]  # no token_type_ids for generate
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == (BOS, EOS, PAD)
    assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == unicodedata.normalize(
        "NFC", text
    )


def test_the_chat_template_renders_the_turn_markers_as_their_ids_in_transformers(
    tokenizer_path, tok
):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tokenizer_path.parent))
    marker = {t: tok.token_to_id(t) for t in CHAT_TOKENS}
    assert list(marker.values()) == [3, 4, 5, 6]  # the ids reserved before chat existed
    messages = [
        {"role": "system", "content": "তুমি একজন সাহায্যকারী।"},
        {"role": "user", "content": "নদীর নাম কী?"},
        {"role": "assistant", "content": "পদ্মা। The Padma."},
        {"role": "user", "content": "আর একটি?"},
    ]

    def body(text):
        return tok.encode(text, add_special_tokens=False).ids

    want = [tok.token_to_id(BOS)]
    for m, role in zip(messages, (SYSTEM, USER, ASSISTANT, USER), strict=True):
        want += [marker[role], *body(m["content"]), marker[END]]
    for prompt in (False, True):
        got = auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        assert got == want + ([marker[ASSISTANT]] if prompt else [])


def test_an_older_vocabulary_without_the_turn_markers_gets_no_template(tmp_path, tokenizer_path):
    from doel.train.data.tokenizer import write_hf_side_files

    data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    for i in range(len(CHAT_TOKENS)):  # as tokenizers made before chat named them
        data["added_tokens"][3 + i]["content"] = f"<|reserved_{i}|>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    write_hf_side_files(tmp_path)
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in conf
    assert "chat_template" in json.loads(
        (tokenizer_path.parent / "tokenizer_config.json").read_text(encoding="utf-8")
    )


def test_resolved_config_is_saved(tokenizer_path):
    saved = json.loads((tokenizer_path.parent / "doel_tokenizer.json").read_text())
    assert saved["config"]["vocab_size"] == 2048
    assert saved["vocab_size"] == 2048
    assert set(saved["sources"]) == {"bn", "en"}


def test_vocab_smaller_than_byte_alphabet_is_refused():
    with pytest.raises(ValueError, match="vocab_size=200"):
        TokenizerConfig(vocab_size=200)
    with pytest.raises(DoelError, match="vocab_size"):
        load_config(TokenizerConfig, None, ["vocab_size=100"])


def test_config_from_toml_with_overrides(tmp_path):
    p = tmp_path / "tok.toml"
    p.write_text('vocab_size = 4096\nstyle = "gpt2"\n')
    cfg = load_config(TokenizerConfig, p, ["min_frequency=3"])
    assert (cfg.vocab_size, cfg.style, cfg.min_frequency) == (4096, "gpt2", 3)
    p.write_text("vocab_sise = 4096\n")
    with pytest.raises(DoelError, match="vocab_sise"):
        load_config(TokenizerConfig, p)


def test_empty_corpus_is_an_error(tmp_path):
    from doel.train.data.tokenizer import train_tokenizer

    (tmp_path / "empty.txt").write_text("\n\n   \n")
    with pytest.raises(DoelError, match="empty"):
        train_tokenizer(
            resolve_sources([str(tmp_path / "empty.txt")]),
            TokenizerConfig(vocab_size=512),
            tmp_path / "out",
            progress=False,
        )


@pytest.mark.parametrize("style", ["doel", "gpt2"])
def test_a_small_corpus_gets_exactly_the_size_asked_and_encodes_as_unpadded(
    tmp_path, sample_paths, style
):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    lines = []
    cfg = TokenizerConfig(vocab_size=4096, style=style)  # the sample runs out near 2,600
    path = train_tokenizer(
        resolve_sources(sample_paths), cfg, tmp_path, progress=False, log=lines.append
    )
    saved = json.loads((tmp_path / "doel_tokenizer.json").read_text())
    learned = saved["learned_tokens"]
    assert learned < 4096 == saved["vocab_size"]
    assert len(lines) == 1 and "ran out of merges" in lines[0] and f"{learned:,}" in lines[0]
    assert Tokenizer.from_file(str(path)).get_vocab_size() == 4096
    assert len(PreTrainedTokenizerFast(tokenizer_file=str(path))) == 4096
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(auto) == 4096 and auto.convert_ids_to_tokens(4095).startswith("<|reserved_")

    # The same file without the padding encodes every text to the same ids.
    data = json.loads(path.read_text(encoding="utf-8"))
    data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] < learned]
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if i < learned}
    (tmp_path / "unpadded.json").write_text(json.dumps(data), encoding="utf-8")
    unpadded = load_tokenizer(tmp_path / "unpadded.json")
    padded = load_tokenizer(path)
    assert unpadded.get_vocab_size() == learned
    texts = [
        "আমাদের গ্রামের নাম নদীপাড়া। The river is slow.",
        "spelled specials: <|reserved_7|> <|reserved_4000|> <|eos|> 日本語",
        *(d for p in sample_paths for d in Path(p).read_text(encoding="utf-8").splitlines()[:50]),
    ]
    for text in texts:
        ids = padded.encode(text).ids
        assert ids == unpadded.encode(text).ids and max(ids) < learned
        assert padded.decode(ids) == unpadded.decode(ids)


def test_a_size_below_the_smallest_possible_is_refused_naming_it(tmp_path, sample_paths):
    # The doel style keeps the 204 characters of its alphabet whole: 8 + 256 + 204.
    with pytest.raises(ValueError, match="choose at least 468"):
        TokenizerConfig(vocab_size=300, style="doel")
    assert TokenizerConfig(vocab_size=300, style="gpt2").vocab_size == 300
    with pytest.raises(ValueError, match="choose at least 264"):
        TokenizerConfig(vocab_size=263, style="gpt2")
    # A corpus's own characters beyond the alphabet raise the floor: found after counting.
    cjk = "".join(chr(0x4E00 + i) for i in range(40))
    (tmp_path / "cjk.txt").write_text(f"{cjk}\n{cjk}\nনদী\n", encoding="utf-8")
    sources = resolve_sources([str(tmp_path / "cjk.txt")])
    with pytest.raises(DoelError, match="smallest possible on this corpus: 508 .*at least 508"):
        train_tokenizer(
            sources, TokenizerConfig(vocab_size=500, style="doel"), tmp_path / "t", progress=False
        )
    assert not (tmp_path / "t" / "tokenizer.json").exists()
    path = train_tokenizer(
        sources, TokenizerConfig(vocab_size=508, style="doel"), tmp_path / "t", log=print
    )
    assert load_tokenizer(path).get_vocab_size() == 508


JOINER_TEXTS = ["র\u200d্যাব এল, কি\u200cন্তু গেল।", "ক্\u200dষ আর ক্\u200cষ", "a\u200cb \u200d 12345"]


def test_the_split_spells_the_joiners_as_characters_other_regex_engines_accept(
    tokenizer_path, sample_paths
):
    # Oniguruma (tokenizers) reads \x{200C}; other engines refuse the escape (onnxruntime-genai's,
    # Python's regex module). The joiners are the characters themselves, in the file too.
    regex = pytest.importorskip("regex")
    written = json.loads(tokenizer_path.read_text(encoding="utf-8"))["pre_tokenizer"]
    assert written["pattern"]["Regex"] == PATTERNS["doel"]
    assert "\\x{" not in PATTERNS["doel"] and "\u200c\u200d" in PATTERNS["doel"]
    with pytest.raises(regex.error):
        regex.compile(PATTERNS["doel"].replace("\u200c\u200d", r"\x{200C}\x{200D}"))
    text = "\n".join(JOINER_TEXTS) + Path(sample_paths[0]).read_text(encoding="utf-8")[:3000]
    assert regex.findall(PATTERNS["doel"], text) == split_pieces(PATTERNS["doel"], text)


def test_a_tokenizer_written_with_the_escaped_joiners_loads_and_gives_the_same_ids(
    tmp_path, tokenizer_path, tok, sample_paths
):
    data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    pattern = data["pre_tokenizer"]["pattern"]["Regex"]
    old = pattern.replace("\u200c", r"\x{200C}").replace("\u200d", r"\x{200D}")
    assert old != pattern
    data["pre_tokenizer"]["pattern"]["Regex"] = old
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), "utf-8")
    before = load_tokenizer(tmp_path)
    text = Path(sample_paths[0]).read_text(encoding="utf-8")[:5000]
    for t in [*JOINER_TEXTS, text]:
        assert before.encode(t).ids == tok.encode(t).ids
