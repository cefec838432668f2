"""The browser page ends a base model's completion where its document ends, as every other
runtime does (tests/train/test_end_of_document.py): benchmarks/runtimes/end_of_document.py's
tiny model, trained on prepare's shards (each document `<|bos|> text <|eos|>`), exported at int4
with --web and run in headless Chromium on the page's default path (doel's kernel): a greedy
completion stops at <|eos|> (web.json's stop ids) before the limit, with doel-serve's ids on
the same bundle and no special token in its text, which is doel-serve's, the Bangla one's leading
space included (the page decodes a few prompt ids in front, as doel-serve does)."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.runtimes import end_of_document as eod

pytest.importorskip("selenium.webdriver", reason="pip install 'doel[dev]'")
pytestmark = pytest.mark.slow  # training, two exports, npm and a browser
NO_CHROMIUM = "headless Chromium is not installed: apt-get install chromium chromium-driver"
PROMPTS = list(eod.PROMPTS.items())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The end-of-document model at int4 with its page (skips where the page cannot be made)."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip(NO_CHROMIUM)
    pytest.importorskip("onnxruntime_genai")  # the export extra
    from doel.export import web
    from doel.export.common import ExportError

    try:
        web.runtime_modules(log=lambda _m: None)
    except ExportError as e:
        pytest.skip(str(e))
    work = tmp_path_factory.mktemp("web-end-of-document")
    return eod.web_export(eod.build(work)["checkpoint"], work)


@pytest.fixture(scope="module")
def page(bundle):
    return eod.browser_page(bundle, eod.PROMPTS)


def test_the_page_runs_its_default_path(page):
    facts = page["facts"]
    assert facts["backend"] == "wasm" and facts["graph"] == "kernel", facts
    assert facts["weights_in_memory"] == "int4", facts


@pytest.mark.parametrize("prompt,ending", PROMPTS, ids=["bn", "en"])
def test_the_page_stops_at_the_end_of_the_document_as_doel_serve_does(page, bundle, prompt, ending):
    """Stopped before the limit at a stop id, the ids doel-serve's engine gives (its own stop
    there too, after as many tokens), the document's ending and no special token in the text."""
    got, want = page[prompt], eod.doel_serve(bundle, prompt)
    assert got["finish"] == "stop" and got["tokens"] < eod.MAX_NEW, got
    assert got["text"].endswith(ending) and "<|" not in got["text"], got
    assert want["finish"] == "stop" and got["tokens"] == want["tokens"], (got, want)
    assert got["ids"] == _engine_ids(bundle, prompt), got


@pytest.mark.parametrize("prompt", [PROMPTS[0][0], PROMPTS[1][0]], ids=["bn", "en"])
def test_the_pages_text_is_doel_serves(page, bundle, prompt):
    assert page[prompt]["text"] == eod.doel_serve(bundle, prompt)["text"]


def _engine_ids(bundle, prompt: str) -> list[int]:
    """doel-serve's engine's greedy ids for `prompt`, stopping at web.json's stop ids."""
    from tokenizers import Tokenizer

    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams

    stops = tuple(json.loads((bundle / "web" / "web.json").read_text())["stop_ids"])
    ids = Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(prompt).ids
    params = SamplingParams(temperature=0, max_tokens=eod.MAX_NEW, stop_token_ids=stops)
    return list(Engine(read_bundle(bundle), threads=1).generate(ids, params))


def test_without_stop_ids_the_page_runs_on_and_the_id_it_stopped_at_is_eos(page, bundle):
    """The control: the same page told to stop at nothing (`stop_ids: []`) runs to the limit,
    and the id it emits where it stopped before is <|eos|>, the one id web.json names first."""
    stops = json.loads((bundle / "web" / "web.json").read_text())["stop_ids"]
    eos = json.loads((bundle / "generation_config.json").read_text())["eos_token_id"]
    assert stops[0] == eos
    free = eod.browser_page(bundle, [p for p, _ in PROMPTS], stop_ids=[])
    for prompt, _ in PROMPTS:
        stopped, ran = page[prompt]["ids"], free[prompt]["ids"]
        assert free[prompt]["finish"] == "length" and len(ran) == eod.MAX_NEW, free[prompt]
        assert ran[: len(stopped)] == stopped and ran[len(stopped)] == eos, (stopped, ran)
