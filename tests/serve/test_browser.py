"""The playground in headless Chromium (Debian's `chromium` and `chromium-driver`, through
selenium) against a real `doel-serve` process: type a Bangla prompt, press Generate, watch the
completion grow piece by piece to the server's own text, and take a screenshot that is a real
PNG with something drawn in it; the page opens in chat mode on a bundle with a chat template,
and draws Bangla with the font the server ships; its JSON-schema box sends response_format
and says so, sending nothing, when the box is not JSON. Skipped only where Chromium is not installed
(`.ci/run` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib

import httpx2
import pytest
from live_server import live_server

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="headless Chromium is not installed: apt-get install chromium chromium-driver "
    "(.ci/run does this)",
)
webdriver = pytest.importorskip("selenium.webdriver", reason="pip install 'doel[dev]'")

PROMPT = "নদীর ধারে একটি ছোট গ্রাম ছিল।"
MAX_TOKENS = 64

# Every change to the completion, with its time: several growing snapshots mean it streamed.
WATCH = """
window.seen = [];
new MutationObserver(() => {
  const c = document.getElementById("completion");
  if (c) window.seen.push([performance.now(), c.textContent]);
}).observe(document.getElementById("output"), {childList: true, subtree: true,
                                                characterData: true});
"""


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    with live_server(tiny_bundle, tmp_path_factory.mktemp("browser")) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",  # containers often have a small /dev/shm
        "--no-proxy-server",  # loopback only, whatever the environment says
        "--window-size=1000,800",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _set(el, value: str) -> None:
    el.clear()
    el.send_keys(value)


def png_facts(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the decoded image) of an 8-bit RGB(A) PNG;
    fails on anything that is not a well-formed one."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body, crc = data[pos + 8 : pos + 8 + n], data[pos + 8 + n : pos + 12 + n]
        assert struct.unpack(">I", crc)[0] == zlib.crc32(kind + body), f"bad CRC in {kind}"
        chunks.setdefault(kind, []).append(body)
        pos += 12 + n
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    assert depth == 8 and color in (2, 6) and b"IEND" in chunks
    raw = zlib.decompress(b"".join(chunks[b"IDAT"]))
    assert len(raw) == height * (1 + width * (3 if color == 2 else 4))
    return width, height, len(set(raw))


def test_the_playground_streams_a_bangla_completion_and_screenshots(
    server, browser, tiny_bundle, tmp_path
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda d: d.find_element(By.ID, "model").text == tiny_bundle.name)  # /v1/models ran
    browser.find_element(By.ID, "mode-completion").click()  # the bundle has a chat template
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys(PROMPT)
    assert prompt.get_property("value") == PROMPT  # typed, key by key, through the keyboard
    _set(browser.find_element(By.ID, "max_tokens"), str(MAX_TOKENS))
    _set(browser.find_element(By.ID, "seed"), "5")  # the default temperature 0.8, seeded
    browser.execute_script(WATCH)
    browser.find_element(By.ID, "go").click()
    status = browser.find_element(By.ID, "status")
    wait.until(lambda _d: re.fullmatch(r"\d+ tokens, \w+|error: .*", status.text))
    assert re.fullmatch(r"\d+ tokens, (length|stop)", status.text), status.text

    shown = browser.find_element(By.ID, "completion").get_property("textContent")
    # The page sent its defaults with our values; seeded, that is one text, which the server
    # also gives whole.
    req = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95}
    req |= {"top_k": 0, "repetition_penalty": 1.1, "seed": 5}
    want = httpx2.post(f"{server.url}/v1/completions", json=req, trust_env=False, timeout=30)
    assert shown and shown == want.json()["choices"][0]["text"]
    assert status.text.startswith(f"{want.json()['usage']['completion_tokens']} tokens")
    steps = [t for _, t in browser.execute_script("return window.seen")]
    growing = [t for i, t in enumerate(steps) if t and (i == 0 or t != steps[i - 1])]
    assert len(growing) >= 2, f"the completion appeared at once, not streamed: {steps}"
    assert all(b.startswith(a) for a, b in zip(growing, growing[1:]))
    assert growing[-1] == shown

    png = browser.get_screenshot_as_png()
    (tmp_path / "playground.png").write_bytes(png)
    width, height, values = png_facts(png)
    assert width >= 800 and height >= 500 and len(png) > 10_000
    assert values > 20, "a blank screenshot"  # text is drawn with many shades of grey


def test_the_playgrounds_chat_mode_keeps_the_conversation(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/")
    wait = WebDriverWait(browser, 20)
    browser.find_element(By.ID, "mode-chat").click()
    assert browser.find_element(By.ID, "go").text == "Send"
    system = "তুমি একজন সহায়ক। ছোট করে উত্তর দাও, বাংলায়।"
    browser.find_element(By.ID, "system").send_keys(system)
    _set(browser.find_element(By.ID, "max_tokens"), "16")
    _set(browser.find_element(By.ID, "seed"), "5")
    status, sent = browser.find_element(By.ID, "status"), []
    done = r"\d+ tokens, \w+; \d+ of \d+ prompt tokens cached|error: .*"
    for message in ("নমস্কার!", "একটা গল্প বলো।"):
        browser.find_element(By.ID, "prompt").send_keys(message)
        browser.find_element(By.ID, "go").click()
        wait.until(lambda _d: re.fullmatch(done, status.text) and not _d.find_element(
            By.ID, "go").get_property("disabled"))  # fmt: skip
        assert not status.text.startswith("error"), status.text
        sent.append({"role": "user", "content": message})
        reply = browser.find_element(By.ID, "reply").get_property("textContent")
        # The page sent the whole conversation with its defaults; seeded, the server gives the
        # same reply whole.
        req = {"messages": [{"role": "system", "content": system}, *sent], "max_tokens": 16}
        req |= {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "repetition_penalty": 1.1}
        url = f"{server.url}/v1/chat/completions"
        want = httpx2.post(url, json=req | {"seed": 5}, trust_env=False, timeout=30).json()
        assert reply == want["choices"][0]["message"]["content"]
        sent.append({"role": "assistant", "content": reply})
    turns = browser.find_elements(By.CSS_SELECTOR, "#transcript .turn")
    assert [t.get_attribute("class") for t in turns] == ["turn user", "turn assistant"] * 2
    cached = int(re.search(r"(\d+) of \d+ prompt tokens cached", status.text).group(1))
    assert cached >= 16, status.text  # turn 2 began where turn 1's cache was
    browser.find_element(By.ID, "reset").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#transcript .turn") == []


def test_the_playground_opens_in_chat_mode_with_its_bengali_font(server, browser):
    """A bundle with a chat template (the tiny one has doel's) opens in chat mode; the page's
    Bengali web font comes from the server and the browser takes it. On a machine without a
    Bengali font (this one, if fc-list names none), the page itself has fetched it to draw its
    Bangla, which was boxes before."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/")
    assert browser.find_element(By.ID, "mode-chat").is_selected()
    assert browser.find_element(By.ID, "go").text == "Send"
    assert browser.find_element(By.ID, "chat").is_displayed()
    assert not browser.find_element(By.ID, "output").is_displayed()
    faces = "return [...document.fonts].filter((f) => f.family.includes('doel Bengali'))"
    status = faces + ".map((f) => f.status)"
    fc_list = shutil.which("fc-list")
    bengali = fc_list and subprocess.run([fc_list, ":lang=bn"], capture_output=True, text=True)
    if bengali and not bengali.stdout.strip():
        WebDriverWait(browser, 20).until(lambda d: d.execute_script(status) == ["loaded"])
    loaded = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "document.fonts.load(\"16px 'doel Bengali'\", 'নদী').then("
        "(fs) => done(fs.map((f) => f.status)), (e) => done(String(e)));"
    )
    assert loaded == ["loaded"], loaded


def test_the_playgrounds_schema_box_sends_response_format_and_refuses_what_is_not_json(
    server, browser
):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/")
    wait = WebDriverWait(browser, 20)
    browser.find_element(By.ID, "mode-chat").click()
    # Every request body the page sends, as it sends it.
    browser.execute_script(
        "window.bodies = []; const f = window.fetch; window.fetch = (u, o) => {"
        " if (o && o.body) window.bodies.push(JSON.parse(o.body)); return f(u, o); };"
    )
    box, status = browser.find_element(By.ID, "schema"), browser.find_element(By.ID, "status")
    box.send_keys('{"type": "object",')
    browser.find_element(By.ID, "prompt").send_keys("হ্যাঁ না?")
    browser.find_element(By.ID, "go").click()
    wait.until(lambda _d: status.text.startswith("error"))
    assert "the JSON schema box is not valid JSON" in status.text
    assert box.get_attribute("aria-invalid") == "true"
    assert browser.execute_script("return window.bodies") == []  # nothing sent
    assert browser.find_elements(By.CSS_SELECTOR, "#transcript .turn") == []

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False  # the document ends after "ok": the reply stops
    _set(box, json.dumps(schema))
    _set(browser.find_element(By.ID, "max_tokens"), "40")
    browser.find_element(By.ID, "go").click()
    wait.until(lambda _d: re.match(r"\d+ tokens, \w+;|error: ", status.text))
    assert re.match(r"\d+ tokens, stop;", status.text), status.text
    (sent,) = browser.execute_script("return window.bodies")
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "playground", "schema": schema, "strict": True},
    }
    reply = browser.find_element(By.ID, "reply").get_property("textContent")
    assert isinstance(json.loads(reply)["ok"], bool) and box.get_attribute("aria-invalid") is None
