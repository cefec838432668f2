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


def _joined(page, spec: dict, graph: str, into):
    """The page's `graph` with its pieces joined back into its weights file, loaded."""
    import onnx

    g = spec["graphs"][graph]
    for p in g["data"]:
        digest = hashlib.sha256((page / p["file"]).read_bytes()).hexdigest()
        assert p["file"] == f"model-{digest[:16]}.bin"
    joined = b"".join((page / p["file"]).read_bytes() for p in g["data"])
    (into / g["data_path"]).write_bytes(joined)
    shutil.copyfile(page / g["model"], into / g["model"])
    return onnx.load(str(into / g["model"])).graph


def _nbits_weights(bundle_graph):
    """Each MatMulNBits of the bundle: name -> (attributes, float weights [N, K])."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from doel.export.web_graph import unpack_nbits

    inits = {t.name: t for t in bundle_graph.initializer}
    out = {}
    for node in (n for n in bundle_graph.node if n.op_type == "MatMulNBits"):
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        q = unpack_nbits(numpy_helper.to_array(inits[node.input[1]]), a["bits"], a["K"])
        scales = numpy_helper.to_array(inits[node.input[2]]).reshape(a["N"], -1)
        out[node.name] = a, q * np.repeat(scales, a["block_size"], axis=1)[:, : a["K"]]
    return out


def test_web_folder_holds_the_bundles_graph_and_its_int8_form_in_hashed_pieces(
    web_bundle, tmp_path
):
    """The bundle's own graph (WebGPU's) with its weights as they are; the int8 graph
    (WebAssembly's default), in which every MatMulNBits became DynamicQuantizeMatMul over int8
    weights a column within half a step of the bundle's; the fp32 graph (on request), whose
    DequantizeLinear + MatMul hold exactly the bundle's integers and scales; the rest of each
    graph is the bundle's; the manifest records the page."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from doel.export import web

    page = web_bundle / "web"
    spec = json.loads((page / "web.json").read_text())
    assert sorted(spec["graphs"]) == ["bundle", "int8"]
    theirs = onnx.load(str(web_bundle / "model.onnx")).graph
    nbits = _nbits_weights(theirs)
    assert nbits
    (tmp_path / "b").mkdir()
    same = _joined(page, spec, "bundle", tmp_path / "b")
    bundle_inits = {t.name: t for t in theirs.initializer}
    for t in same.initializer:
        assert (
            numpy_helper.to_array(t).tobytes()
            == numpy_helper.to_array(bundle_inits[t.name]).tobytes()
        ), t.name
    assert [n.op_type for n in same.node] == [n.op_type for n in theirs.node]
    assert "logits_to_keep" in bundle_inits and spec["logits_to_keep"]
    assert "logits_to_keep" not in {t.name for t in same.initializer}
    (tmp_path / "i8").mkdir()
    int8 = _joined(page, spec, "int8", tmp_path / "i8")
    mine = {t.name: numpy_helper.to_array(t) for t in int8.initializer}
    assert spec["graphs"]["int8"]["rewritten_matmuls"] == len(nbits)
    for name, (_a, want) in nbits.items():
        w8, scale = mine[f"{name}/w8"], mine[f"{name}/w8_scale"]
        assert w8.dtype == np.int8 and scale.shape == (want.shape[0],)
        err = np.abs(w8.astype(np.float32) * scale - want.T)
        assert (err <= scale / 2 + 1e-6).all(), name
    assert [n.op_type for n in int8.node if n.op_type != "DynamicQuantizeMatMul"] == [
        n.op_type for n in theirs.node if n.op_type != "MatMulNBits"
    ]
    # The fp32 graph, which bench_web asks for: the same integers and scales, dequantized.
    fp32 = tmp_path / "fp32"
    spec32 = web.write_web(web_bundle, fp32, log=lambda _m: None, graphs=("fp32",))
    assert sorted(spec32["graphs"]) == ["bundle", "fp32"]
    (tmp_path / "f").mkdir()
    dq = {
        t.name: numpy_helper.to_array(t)
        for t in _joined(fp32, spec32, "fp32", tmp_path / "f").initializer
    }
    for name, (a, want) in nbits.items():
        got = dq[f"{name}/q"].astype(np.float32)
        got = got * np.repeat(dq[f"{name}/scales"], a["block_size"], axis=0)[: a["K"]]
        assert np.array_equal(got.T, want), name
    # Small pieces: the same bytes, more files.
    data = tmp_path / "i8" / spec["graphs"]["int8"]["data_path"]
    small = web.split_data(data, tmp_path, chunk=100_000)
    joined = b"".join((tmp_path / p["file"]).read_bytes() for p in small)
    assert len(small) > 1 and joined == data.read_bytes()
    manifest = json.loads((web_bundle / "manifest.json").read_text())
    assert manifest["web"]["pieces"] == len(spec["data"])
    for name in (
        "index.html",
        "worker.js",
        "sw.js",
        "ort.wasm.min.js",
        "ort-wasm-simd-threaded.wasm",
        "ort.webgpu.min.js",
        "ort-wasm-simd-threaded.asyncify.wasm",
    ):
        assert (page / name).is_file(), name
    assert not [p for p in page.iterdir() if p.suffix == ".data"]  # only the pieces are served


def test_an_fp32_bundles_page_has_one_graph_and_every_piece_of_it(
    web_bundle, tiny_bundle, tmp_path
):
    """No quantized matmuls: the int8 graph would be the bundle's, so the page has one graph,
    and dropping the other never deletes a piece the two share (pieces are named by content)."""
    from doel.export import web

    spec = web.write_web(tiny_bundle, tmp_path / "web", log=lambda _m: None)
    assert sorted(spec["graphs"]) == ["bundle"] and spec["data"]
    assert all((tmp_path / "web" / p["file"]).is_file() for p in spec["data"])
    assert not (tmp_path / "web" / web.GRAPHS["int8"][0]).exists()


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
        # the page's default: no WebGPU without --enable-unsafe-webgpu, int8 on WebAssembly
        driver.doel_url = f"http://127.0.0.1:{server.server_address[1]}/"
        driver.get(driver.doel_url)
        facts = _script(driver, "return await doel.ready;")
        yield driver, facts
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()


def test_page_tokenizes_as_tokenizers_does(page, web_bundle, sample_paths):
    from tokenizers import Tokenizer

    driver, facts = page
    # The default on WebAssembly: doel's kernel on the bundle's own int4 weights, its relaxed-
    # SIMD build (Chromium computes that dot product right: dk_selftest), one thread.
    assert facts["backend"] == "wasm" and facts["graph"] == "kernel", facts
    assert facts["weights_in_memory"] == "int4" and facts["kernel"] == "relaxed"
    assert facts["threads"] == 1 and "doel's kernel (relaxed SIMD)" in facts["why"]
    shown = driver.find_element("id", "facts").get_property("textContent")
    assert "doel's kernel, relaxed SIMD" in shown
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

    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams

    stops = tuple(json.loads((bundle / "web" / "web.json").read_text())["stop_ids"])
    ids = Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(prompt).ids
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=stops)
    return list(Engine(read_bundle(bundle), threads=1).generate(ids, params))


# The page's logits against the engine's (max |difference| over the largest |logit|): the tiny
# model's random weights give near-constant greedy ids, so its logits are the stronger check;
# measured 0.003 (WebGPU, the bundle's graph) to 0.007 (int8), the engine rounding activations
# to int8 at accuracy level 4 and the page's kernels otherwise.
LOGITS_REL_TOL = 0.02


def _logits_close(driver, bundle, prompt: str) -> float:
    """The page's last prompt logits against doel-serve's engine's; returns the error."""
    import numpy as np
    from tokenizers import Tokenizer

    from doel.serve.core.engine import Engine, read_bundle

    req = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "return_logits": True}
    got = np.array(
        _script(driver, "return await doel.generate(arguments[0]);", req)["prompt_logits"]
    )
    ids = Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(prompt).ids
    want = Engine(read_bundle(bundle), threads=1).forward(ids, 0)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= LOGITS_REL_TOL, f"{prompt!r}: page logits differ by {err:.4f} of the largest"
    return err


def _cluster_boundary(text: str, k: int) -> bool:
    """Whether a cut before text[k] leaves every grapheme cluster whole (serve/core/textstream.py's
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

    from doel.serve.core.engine import Engine, read_bundle
    from doel.serve.core.sampling import SamplingParams

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
        _logits_close(driver, web_bundle, prompt)
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
        # The bundle's own graph (int4 MatMulNBits): smaller, slower, the same greedy ids.
        assert plain["weights_in_memory"] == "int4" and plain["graph"] == "bundle"
        req = {"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0}
        got = _script(driver, "return await doel.generate(arguments[0]);", req)
        assert got["ids"] == _engine_ids(web_bundle, PROMPTS[0])
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(url + "?weights=int8")  # registers sw.js, then reloads itself once
        wait = WebDriverWait(driver, 30, ignored_exceptions=(WebDriverException,))
        wait.until(lambda d: d.execute_script("return self.crossOriginIsolated && !!window.doel"))
        facts = _script(driver, "return await doel.ready;")
        cores = driver.execute_script("return navigator.hardwareConcurrency")
        # onnxruntime-web's threads (doel's kernel runs one)
        assert facts["isolated"] and facts["threads"] == min(cores, 4)
        assert facts["graph"] == "int8" and facts["weights_in_memory"] == "int8"
        assert driver.execute_script("return !!navigator.serviceWorker.controller")
    finally:
        server.shutdown()
        server.server_close()


def test_the_kernel_in_node_gives_the_engines_loss(web_bundle):
    """benchmarks/web/web_kernel_node.py (bench_web's loss of the page's own numbers): the kernel
    in Node.js scores a window as doel-serve's engine does, a token at a time."""
    import shutil

    import numpy as np
    from tokenizers import Tokenizer

    from benchmarks.web.web_kernel_node import kernel_nats
    from doel.serve.core.engine import Engine, read_bundle

    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    tok = Tokenizer.from_file(str(web_bundle / "tokenizer.json"))
    windows = [tok.encode(p).ids for p in PROMPTS]
    engine = Engine(read_bundle(web_bundle), threads=1)
    for w, got in zip(windows, kernel_nats(web_bundle / "web", windows)):
        want = 0.0
        for t in range(len(w) - 1):
            z = engine.forward(w[: t + 1], 0).astype(np.float64)
            want += np.log(np.exp(z - z.max()).sum()) + z.max() - z[w[t + 1]]
        assert got == pytest.approx(want, rel=0.01), (w, got, want)


def test_a_damaged_piece_is_refused_and_not_kept(page, web_bundle, tmp_path):
    """The kernel streams each piece into its memory and checks its sha256 there: a piece
    changed on the server fails the load in one line naming it, and is dropped from the
    cache, so a reload fetches it again."""
    from doel.export.web import static_server

    driver, _ = page
    web = tmp_path / "web"
    shutil.copytree(web_bundle / "web", web)
    first = json.loads((web / "web.json").read_text())["graphs"]["bundle"]["data"][0]["file"]
    data = bytearray((web / first).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (web / first).write_bytes(bytes(data))
    server = static_server(web)  # another port: another origin, an empty Cache Storage
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        out = driver.execute_async_script(
            "const done = arguments[0];"
            "doel.ready.then(() => done('loaded'), (e) => done(String(e)));"
        )
        assert first in out and "damaged (sha256 differs)" in out, out
        kept = _script(
            driver, f"return !!(await (await caches.open('doel-web-v1')).match('{first}'));"
        )
        assert kept is False
    finally:
        server.shutdown()
        server.server_close()
        driver.get(driver.doel_url)
        _script(driver, "return await doel.ready;")


# Every other way the page can run on WebAssembly: the kernel's plain-SIMD build (browsers
# without relaxed SIMD), and onnxruntime-web with int8 weights (where the kernel cannot run).
OTHER_PATHS = {
    "?simd=plain": {"graph": "kernel", "kernel": "plain", "weights_in_memory": "int4"},
    "?weights=int8": {"graph": "int8", "kernel": None, "weights_in_memory": "int8"},
}


@pytest.mark.parametrize("query", OTHER_PATHS)
def test_each_webassembly_path_continues_greedily_as_doel_serve(page, web_bundle, query):
    driver, _ = page
    base = driver.doel_url
    try:
        driver.get(base + query)
        facts = _script(driver, "return await doel.ready;")
        assert {k: facts[k] for k in OTHER_PATHS[query]} == OTHER_PATHS[query], facts
        for prompt in PROMPTS:
            req = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
            got = _script(driver, "return await doel.generate(arguments[0]);", req)
            assert got["ids"] == _engine_ids(web_bundle, prompt), (query, prompt)
            _logits_close(driver, web_bundle, prompt)
    finally:
        driver.get(base)
        _script(driver, "return await doel.ready;")


# How the WebGPU test asks Chromium for an adapter: headless Chromium on Linux offers WebGPU only
# with this switch, and then (no GPU here) SwiftShader's software adapter.
WEBGPU_SWITCHES = ("--enable-unsafe-webgpu",)


def test_page_runs_on_webgpu_where_the_browser_gives_an_adapter(page, web_bundle):
    """With an adapter the page picks WebGPU by itself (the bundle's int4 graph, MatMulNBits on
    the WebGPU EP), says which adapter and why, and continues both prompts with doel-serve's
    engine's greedy ids. A software adapter proves the ids, never a speed."""
    from selenium.webdriver.chrome.service import Service

    from doel.export.web import static_server

    server = static_server(web_bundle / "web")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", *WEBGPU_SWITCHES):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
    driver.set_script_timeout(60)
    try:
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        facts = _script(driver, "return await doel.ready;")
        if facts["backend"] != "webgpu":
            pytest.skip(
                f"Chromium {' '.join(WEBGPU_SWITCHES)} gave no WebGPU adapter: the page says "
                f"{facts['why']!r} (WebGPU needs a GPU driver or SwiftShader's Vulkan in Chromium)"
            )
        assert facts["adapter"] and facts["weights_in_memory"] == "int4"
        assert facts["graph"] == "bundle" and "adapter" in facts["why"]
        shown = driver.find_element("id", "facts").get_property("textContent")
        assert "WebGPU" in shown and facts["adapter"] in shown
        if facts["software_adapter"]:
            assert "software adapter" in shown  # the page never passes its speed off as a GPU's
        # Greedy ids on the Bangla prompt (SwiftShader: ~6 s of shader compiling at the first
        # run, then ~0.3 s a token, so 8 of them), the prompt's logits on both.
        req = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        got = _script(driver, "return await doel.generate(arguments[0]);", req)
        assert got["ids"] == _engine_ids(web_bundle, PROMPTS[0])[:8]
        assert got["kv_cache_location"] == "gpu-buffer"  # the cache never leaves the GPU
        for prompt in PROMPTS:
            _logits_close(driver, web_bundle, prompt)
        # Forced back to WebAssembly, the page says so.
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/?backend=wasm")
        forced = _script(driver, "return await doel.ready;")
        assert forced["backend"] == "wasm" and "backend=wasm" in forced["why"]
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
