"""Structured output's grammar module (serve/core/structured.py) on doel's default tokenizer (spm:
SentencePiece BPE with byte-fallback tokens): what compiles, what is refused by name, and
that a walk through the masks only ever makes documents that parse and validate, Bangla
included, with the stop ids allowed exactly where the grammar accepts."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from doel.serve.core.structured import Grammars
from doel.serve.edge.refusal import RequestError
from doel.train.data.textio import resolve_sources
from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

VOCAB = 1100  # the model's logits: wider than the tokenizer, as a padded head is
EOS, END = 1, 6  # <|eos|>, <|end|> in doel's special tokens

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["ঢাকা", "চট্টগ্রাম", "Sylhet"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def spm(tmp_path_factory, sample_paths):
    out = tmp_path_factory.mktemp("spm")
    cfg = TokenizerConfig(vocab_size=1024, min_frequency=1, style="spm")
    path = train_tokenizer(resolve_sources(sample_paths), cfg, out, progress=False)
    return (path / "tokenizer.json" if path.is_dir() else path).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def grammars(spm) -> Grammars:
    return Grammars(spm, VOCAB, EOS)


def walk(grammars: Grammars, fmt, seed: int, limit: int = 200) -> tuple[bytes, bool]:
    """Random tokens among those the mask allows (uniform logits at temperature 1): the bytes
    made, and whether the grammar accepted them when it ended."""
    rng, c, out = np.random.default_rng(seed), fmt.start(), []
    tok = grammars.tokenizer
    for _ in range(limit):
        c.fill()
        logits = c.mask(rng.normal(size=VOCAB).astype(np.float32), (EOS, END))
        allowed = np.flatnonzero(np.isfinite(logits))
        assert allowed.max() < tok.vocab_size and not (set(allowed) - set(range(VOCAB)))
        assert (EOS in allowed) == c.matcher.is_accepting() == (END in allowed)
        token = int(rng.choice(allowed))
        if token in (EOS, END):
            c.advance(None)
            break
        c.advance(token)
        out.append(token)
        if c.done:
            break
    return tok.decode_bytes(out), c.finished


def test_random_walks_through_the_mask_make_valid_bangla_documents(grammars):
    fmt = grammars.json_schema(CITY)
    finished = 0
    for seed in range(30):
        text, done = walk(grammars, fmt, seed)
        if done:
            finished += 1
            jsonschema.validate(json.loads(text.decode("utf-8")), CITY)
    assert finished >= 20  # most end within the limit; every one that ends is valid


def test_the_same_schema_compiles_once_and_each_request_gets_its_own_state(grammars):
    a = grammars.json_schema(CITY)
    assert grammars.json_schema(json.loads(json.dumps(CITY))) is a  # cached by its text
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY, "strict": True}}
    assert grammars.response_format(rf) is a
    assert grammars.response_format({"type": "json_schema", "name": "c", "schema": CITY}) is a
    one, two = a.start(), a.start()
    one.fill()
    one.advance(int(np.flatnonzero(np.isfinite(one.mask(np.zeros(VOCAB), ())))[0]))
    assert one.matcher.is_accepting() is False and two.matcher.reset()  # untouched


def test_json_object_is_any_object_and_text_is_no_format(grammars):
    assert grammars.response_format({"type": "text"}) is None
    fmt = grammars.response_format({"type": "json_object"})
    for seed in range(10):
        text, done = walk(grammars, fmt, seed)
        if done:
            assert isinstance(json.loads(text.decode("utf-8")), dict)


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "object", "not": {"required": ["a"]}}, "not"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ],
)
def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_the_keyword(grammars, schema, named):
    with pytest.raises(RequestError) as e:
        grammars.json_schema(schema, "response_format.json_schema.schema")
    assert e.value.status == 400 and named in e.value.message
    assert e.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "rf, param",
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, None),
    ],
)
def test_malformed_response_formats_are_refused_by_name(grammars, rf, param):
    with pytest.raises(RequestError) as e:
        grammars.response_format(rf)
    assert e.value.status == 400
    assert e.value.param == (param or "response_format.json_schema.schema")
