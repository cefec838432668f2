"""`doel-export --web` in headless Chromium (Debian's `chromium` and `chromium-driver`, through
selenium): the tiny int4 bundle's page, served as static files, tokenizes as `tokenizers` does,
continues Bangla and English prompts greedily with doel-serve's engine's ids, streams whole
Bengali clusters, and draws Bangla text. The npm packages come from the registry on first use
into doel's cache folder (export/web.py); without npm the browser tests skip, saying so."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import unicodedata

import pytest

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="pip install 'doel[dev]'")
pytestmark = pytest.mark.slow  # an export, npm and a browser

PROMPTS = ["নদীর ধারে একটি ছোট গ্রাম ছিল।", "The river was quiet that morning."]
NEW_TOKENS = 24
# Beyond the prompts: the sample's lines and text that tests a split regex's corners.
EDGE = [
    "  two  spaces\tand\ttabs\r\nlines\n",
    "য় ড় ঢ় and decomposed য\u09bc, ক্\u200dষ ক্\u200cষ, ৳১,২৩৪.৫০ 12345",
    "<|bos|>hi<|eos|> I'LL we'Ve DON'T “উদ্ধৃতি” ‘কথা’ — শেষ…",
    "emoji 😀🇧🇩, é e\u0301, nbsp\u00a0em\u2003ideographic\u3000nel\u0085",
]


def _script(driver, body: str, *args):
    """Run `body` (JS that may await; its value comes back) in the page."""
    js = (
        "const done = arguments[arguments.length - 1];"
        f"(async () => {{ {body} }})().then(done, (e) => done({{error: String(e)}}));"
    )
    out = driver.execute_async_script(js, *args)
    assert not (isinstance(out, dict) and "error" in out), out
    return out


@pytest.fixture(scope="module")
def web_bundle(tiny_bundle, tmp_path_factory):
    """tiny_bundle's checkpoint at int4 with --web (skips where the npm packages cannot come)."""
    from doel.export import web
    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.export.common import ExportError

    try:
        web.runtime_modules(log=lambda _m: None)
    except ExportError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("web") / "bundle-int4"
    opts = ExportOptions(quant="int4", web=True, eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", out, opts)
    return out


def test_web_folder_holds_the_bundles_weights_in_hashed_pieces(web_bundle, tmp_path):
    """Each piece is named by its hash; joined, they hold the page's graph's weights, in which
    every MatMulNBits became DequantizeLinear + MatMul over exactly the bundle's integers and
    scales; the rest of the graph is the bundle's; the manifest records the page."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from doel.export import web

    page = web_bundle / "web"
    spec = json.loads((page / "web.json").read_text())
    for p in spec["data"]:
        digest = hashlib.sha256((page / p["file"]).read_bytes()).hexdigest()
        assert p["file"] == f"model-{digest[:16]}.bin"
    joined = b"".join((page / p["file"]).read_bytes() for p in spec["data"])
    (tmp_path / spec["data_path"]).write_bytes(joined)
    shutil.copyfile(page / "model.onnx", tmp_path / "model.onnx")
    ours = onnx.load(str(tmp_path / "model.onnx")).graph
    theirs = onnx.load(str(web_bundle / "model.onnx")).graph
    mine = {t.name: t for t in ours.initializer}
    bundle = {t.name: t for t in theirs.initializer}
    nbits = [n for n in theirs.node if n.op_type == "MatMulNBits"]
    assert nbits and spec["dequantized_matmuls"] == len(nbits)
    assert not [n for n in ours.node if n.op_type == "MatMulNBits"]
    for node in nbits:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        q = web.unpack_nbits(numpy_helper.to_array(bundle[node.input[1]]), a["bits"], a["K"])
        scales = numpy_helper.to_array(bundle[node.input[2]]).reshape(a["N"], -1)
        want = q * np.repeat(scales, a["block_size"], axis=1)[:, : a["K"]]  # [N, K]
        got_q = numpy_helper.to_array(mine[f"{node.name}/q"]).astype(np.float32)
        got_s = numpy_helper.to_array(mine[f"{node.name}/scales"])
        got = got_q * np.repeat(got_s, a["block_size"], axis=0)[: a["K"]]  # [K, N]
        assert np.array_equal(got.T, want), node.name
    rest = [n for n in theirs.node if n.op_type != "MatMulNBits"]
    assert [n for n in ours.node if n.op_type not in ("DequantizeLinear", "MatMul")] == [
        n for n in rest if n.op_type != "MatMul"
    ]
    assert [i.name for i in ours.input] == [i.name for i in theirs.input]
    assert "logits_to_keep" in bundle and "logits_to_keep" not in mine and spec["logits_to_keep"]
    # Small pieces: the same bytes, more files.
    small = web.split_data(tmp_path / spec["data_path"], tmp_path, chunk=100_000)
    assert len(small) > 1 and b"".join((tmp_path / p["file"]).read_bytes() for p in small) == joined
    manifest = json.loads((web_bundle / "manifest.json").read_text())
    assert manifest["web"]["pieces"] == len(spec["data"])
    for name in (
        "index.html",
        "worker.js",
        "sw.js",
        "ort.wasm.min.js",
        "ort-wasm-simd-threaded.wasm",
    ):
        assert (page / name).is_file(), name
    assert not (page / spec["data_path"]).exists()  # only the pieces are served


@pytest.fixture(scope="module")
def page(web_bundle):
    """The web folder on a loopback static server (with the isolation headers: two threads) in
    headless Chromium, loaded."""
    if not (CHROMIUM and DRIVER):
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    from doel.export.web import static_server

    server = static_server(web_bundle / "web")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        "--no-proxy-server",
        "--disable-background-networking",  # no calls out of a closed network at start
        "--disable-component-update",
        "--no-first-run",
        "--window-size=900,700",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
    driver.set_script_timeout(60)
    try:
        # fp32 weights in memory whatever the machine reports (the page picks by memory)
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/?memory=fp32")
        facts = _script(driver, "return await doel.ready;")
        yield driver, facts
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


def test_page_tokenizes_as_tokenizers_does(page, web_bundle, sample_paths):
    from tokenizers import Tokenizer

    driver, facts = page
    assert facts["isolated"] and facts["threads"] >= 1 and facts["weights_in_memory"] == "fp32"
    tok = Tokenizer.from_file(str(web_bundle / "tokenizer.json"))
    texts = PROMPTS + EDGE
    for path in sample_paths:
        with open(path, encoding="utf-8") as f:
            texts += [line for line in f.read().splitlines() if line][:12]
    got = _script(driver, "return await doel.encode(arguments[0]);", texts)
    want = [tok.encode(t).ids for t in texts]
    wrong = [(t, g, w) for t, g, w in zip(texts, got, want) if g != w]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, first: {wrong[0]}"


def _engine_ids(bundle, prompt: str) -> list[int]:
    """doel-serve's engine's greedy ids for `prompt`, stopping where the page stops."""
    from tokenizers import Tokenizer

    from doel.serve.engine import Engine, read_bundle
    from doel.serve.sampling import SamplingParams

    stops = tuple(json.loads((bundle / "web" / "web.json").read_text())["stop_ids"])
    ids = Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(prompt).ids
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=stops)
    return list(Engine(read_bundle(bundle), threads=1).generate(ids, params))


def _cluster_boundary(text: str, k: int) -> bool:
    """Whether a cut before text[k] leaves every grapheme cluster whole (serve/textstream.py's
    Bengali rule: a mark or joiner continues a cluster, and so does a consonant after a virama
    or joiner)."""
    if k in (0, len(text)):
        return True
    ch, before = text[k], text[k - 1]
    mark = unicodedata.category(ch).startswith("M") or ch in "\u200c\u200d"
    joined = "\u0980" <= ch <= "\u09ff" and before in "\u09cd\u200c\u200d"
    return not (mark or joined)


def test_page_continues_greedily_as_doel_serve_and_streams_whole_clusters(
    page, web_bundle, tmp_path
):
    from tokenizers import Tokenizer

    from doel.serve.engine import Engine, read_bundle
    from doel.serve.sampling import SamplingParams

    driver, _ = page
    engine = Engine(read_bundle(web_bundle), threads=1)
    tok = Tokenizer.from_file(str(web_bundle / "tokenizer.json"))
    stops = tuple(json.loads((web_bundle / "web" / "web.json").read_text())["stop_ids"])
    for prompt in PROMPTS:
        got = _script(
            driver,
            "const chunks = [];"
            "const r = await doel.generate(arguments[0], (t) => chunks.push(t));"
            "return {...r, chunks};",
            {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0},
        )
        ids = tok.encode(prompt).ids
        assert got["prompt_ids"] == ids
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=stops)
        want = list(engine.generate(ids, params))
        assert got["ids"] == want, f"{prompt!r}: page {got['ids']} != doel-serve {want}"
        text = "".join(got["chunks"])
        assert text == got["text"] == tok.decode(want, skip_special_tokens=True)
        cuts = [len("".join(got["chunks"][:i])) for i in range(1, len(got["chunks"]))]
        assert all(_cluster_boundary(text, k) for k in cuts), got["chunks"]
    # The page as a person sees it: the prompt box's Bangla, typed and continued.
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "temperature").clear()
    driver.find_element(By.ID, "temperature").send_keys("0")
    driver.find_element(By.ID, "go").click()
    _script(
        driver,
        "while (document.getElementById('go').disabled) await new Promise(r => setTimeout(r, 50));",
    )
    shown = driver.find_element(By.ID, "completion").get_property("textContent")
    ids = tok.encode(PROMPTS[0]).ids
    # The page's defaults but greedy: 64 tokens, repetition penalty 1.1.
    params = SamplingParams(
        temperature=0, max_tokens=64, repetition_penalty=1.1, stop_token_ids=stops
    )
    want = list(engine.generate(ids, params))
    assert shown == tok.decode(want, skip_special_tokens=True)
    png = driver.get_screenshot_as_png()
    (tmp_path / "web.png").write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_page_isolates_itself_where_the_host_sends_no_headers(page, web_bundle):
    """On a plain static server (as GitHub Pages), sw.js makes the page cross-origin isolated
    after one reload, so it still gets threads; with ?no-sw it runs one thread, and says so."""
    from doel.export.web import static_server

    driver, _ = page
    server = static_server(web_bundle / "web", isolated=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        driver.get(url + "?no-sw&memory=low")
        plain = _script(driver, "return await doel.ready;")
        assert not plain["isolated"] and plain["threads"] == 1
        # Weights int4 in memory (MatMulNBits again): slower, the same greedy ids.
        assert plain["weights_in_memory"] == "int4"
        req = {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0}
        got = _script(driver, "return await doel.generate(arguments[0]);", req)
        assert got["ids"] == _engine_ids(web_bundle, PROMPTS[0])
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(url)  # registers sw.js, then reloads itself once
        wait = WebDriverWait(driver, 30, ignored_exceptions=(WebDriverException,))
        wait.until(lambda d: d.execute_script("return self.crossOriginIsolated && !!window.doel"))
        facts = _script(driver, "return await doel.ready;")
        cores = driver.execute_script("return navigator.hardwareConcurrency")
        assert facts["isolated"] and facts["threads"] == min(cores, 4)
        assert driver.execute_script("return !!navigator.serviceWorker.controller")
    finally:
        server.shutdown()
        server.server_close()
