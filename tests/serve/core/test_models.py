"""Several models in one server (serve/core/models.py): two bundles of the tiny model, "chat" (its
tokenizer has the chat template) and "base" (taken out), both answer and /v1/models says what
each is; an unknown name is a 404 naming the ones there are; a model loads on its first request
while another streams, the stream's gaps within 2x those of a stream alone; an idle model is
unloaded after --keep-alive (its engine collected, the process's RSS falls) and loaded again by
its next request; --max-models 1 swaps models without failing a request in flight; a damaged
bundle and a GGUF folder among good ones are named and the good ones served."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
import time
import weakref
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from ready import ready

from doel.contracts import memory
from doel.serve.edge.app import create_app, default_loader
from doel.serve.settings import Settings

PROMPT = "নদীর ধারে"
PACE = 0.02  # seconds added to each decode step, so that a stream's gaps are measurable
TOKENS = 40  # a paced stream: about a second


@pytest.fixture(scope="module")
def pair(tiny_bundle, tmp_path_factory) -> tuple[Path, Path]:
    """Copies of the tiny bundle: chat as it is, base without the chat template (its
    manifest's sha256 of the config written again, as an export would)."""
    root = tmp_path_factory.mktemp("models")
    chat, base = root / "chat", root / "base"
    shutil.copytree(tiny_bundle, chat)
    shutil.copytree(tiny_bundle, base)
    path = base / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    del config["chat_template"]
    path.write_text(json.dumps(config), encoding="utf-8")
    manifest = json.loads((base / "manifest.json").read_text(encoding="utf-8"))
    data = path.read_bytes()
    manifest["files"][path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (base / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return chat, base


def pss_kib() -> int:
    """What the system pays for this process (its Pss: doel.contracts.memory), in KiB."""
    return memory.measure().pss_bytes // 1024


def paced_loader(pause: dict[str, float] | None = None):
    """default_loader, each decode step PACE longer, and the load of a model named in `pause`
    that many seconds longer (a large model's read from disk), on the loading thread."""

    def load(settings: Settings):
        svc = default_loader(settings)
        decode = svc.engine.decode

        def slow(*args, **kw):
            time.sleep(PACE)
            return decode(*args, **kw)

        svc.engine.decode = slow
        time.sleep((pause or {}).get(settings.model_name, 0))
        return svc

    return load


def app_of(pair, loader=default_loader, **kw):
    chat, base = pair
    settings = Settings(bundle=str(chat), bundles=(str(base),), threads=1, **kw)
    return create_app(settings, loader=loader)


def states(c: TestClient) -> dict[str, str]:
    return c.get("/health").json()["models"]


def until(c: TestClient, want: dict[str, str], timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while states(c) != want:
        assert time.monotonic() < end, states(c)
        time.sleep(0.05)


def metric(c: TestClient, line_start: str) -> float:
    lines = [x for x in c.get("/metrics").text.splitlines() if x.startswith(line_start + " ")]
    assert len(lines) == 1, line_start
    return float(lines[0].split()[-1])


def complete(c: TestClient, model: str | None = None, n: int = 8) -> dict:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0}
    r = c.post("/v1/completions", json=body | ({"model": model} if model else {}))
    assert r.status_code == 200, r.text
    return r.json()


def stream_times(c: TestClient, model: str, at_third=None) -> tuple[list[float], dict]:
    """The arrival time of each chunk of a greedy stream of TOKENS tokens, and its usage;
    `at_third()` is called when the third chunk has come."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "seed": 3}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    times, usage = [], None
    with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk["choices"]:
                times.append(time.perf_counter())
                if len(times) == 3 and at_third is not None:
                    at_third()
    return times, usage


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        out["start"] = time.perf_counter()
        out["result"] = fn()
        out["end"] = time.perf_counter()

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_two_bundles_in_one_server_both_answer_and_an_unknown_name_is_404(pair):
    with TestClient(app_of(pair)) as c:
        cards = {m["id"]: m for m in ready(c).get("/v1/models").json()["data"]}
        assert list(cards) == ["chat", "base"]
        assert [cards[n]["chat"] for n in cards] == [True, False]
        assert {(m["quant"], m["max_model_len"]) for m in cards.values()} == {("fp32", 96)}
        assert [cards[n]["state"] for n in cards] == ["loaded", "unloaded"]  # base: on request
        default = complete(c)
        assert default["model"] == "chat"
        texts = [default["choices"][0]["text"]]
        for name in ("chat", "base"):
            answer = complete(c, name)
            assert answer["model"] == name
            texts.append(answer["choices"][0]["text"])
        assert len(set(texts)) == 1 and texts[0]  # the same weights, greedy
        messages = {"messages": [{"role": "user", "content": "নমস্কার"}], "max_tokens": 4}
        assert c.post("/v1/chat/completions", json=messages | {"model": "chat"}).status_code == 200
        no_template = c.post("/v1/chat/completions", json=messages | {"model": "base"})
        assert no_template.status_code == 400 and "no chat template" in no_template.text
        r = c.post("/v1/completions", json={"model": "nope", "prompt": PROMPT})
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == "model", r.text
        assert err["message"] == "the model 'nope' does not exist; this server has 'chat', 'base'"
        assert states(c) == {"chat": "loaded", "base": "loaded"}
        assert metric(c, 'doel_model_state{model="base",state="loaded"}') == 1
        assert metric(c, 'doel_model_state{model="base",state="unloaded"}') == 0
        assert metric(c, 'doel_model_loads_total{model="base"}') == 1


def test_a_model_loads_on_its_first_request_while_another_streams_without_a_stutter(pair):
    """base's load takes 0.4 s longer than the tiny model's (a large model's read): on the
    event loop it would hold chat's stream that long; on its thread, the stream's longest gap
    stays within twice that of the same stream with nothing loading."""
    with TestClient(app_of(pair, loader=paced_loader({"base": 0.4}))) as c:
        ready(c)
        stream_times(c, "chat")  # warm
        alone, _ = stream_times(c, "chat")
        loading: dict = {}

        def load_base():
            thread, loading["out"] = in_thread(lambda: complete(c, "base", 2))
            loading["thread"] = thread

        during, usage = stream_times(c, "chat", at_third=load_base)
        loading["thread"].join()
        out = loading["out"]
        assert out["result"]["model"] == "base" and out["end"] - out["start"] >= 0.4
        assert during[0] < out["start"] and out["end"] < during[-1]  # loaded while it streamed
        assert usage["completion_tokens"] == TOKENS
        worst_alone = max(b - a for a, b in zip(alone, alone[1:]))
        worst = max(b - a for a, b in zip(during, during[1:]))
        print(f"longest gap: {worst * 1e3:.0f} ms loading, {worst_alone * 1e3:.0f} ms alone")
        assert worst <= 2 * worst_alone


def test_an_idle_model_is_unloaded_after_keep_alive_and_its_next_request_loads_it(pair):
    with TestClient(app_of(pair, keep_alive=1.0)) as c:
        ready(c)
        before = pss_kib()
        complete(c, "base")
        engine = weakref.ref(c.app.state.models.all["base"].service.engine)
        loaded = pss_kib()
        until(c, {"chat": "unloaded", "base": "unloaded"})
        after = pss_kib()
        print(f"Pss {before} KiB, {loaded} KiB with both loaded, {after} KiB with none")
        assert engine() is None  # every reference to the engine and its session dropped
        assert c.app.state.service is None
        assert after < loaded - 1024  # two tiny models hold about 4 MiB each
        assert c.get("/health").status_code == 200  # unloaded is not unhealthy
        assert complete(c, "base")["model"] == "base"
        assert states(c)["base"] == "loaded"
        assert metric(c, 'doel_model_loads_total{model="base"}') == 2


def test_max_models_1_swaps_models_without_failing_a_request_in_flight(pair):
    """chat streams while base is asked for: base loads beside it (chat is busy, never unloaded
    under its request) and answers; the first to drain (base) is unloaded at once, back to one
    model; asking for base again unloads idle chat first."""
    with TestClient(app_of(pair, loader=paced_loader(), max_models=1)) as c:
        ready(c)
        asked: dict = {}

        def ask_base():
            asked["thread"], asked["out"] = in_thread(lambda: complete(c, "base", 2))

        times, usage = stream_times(c, "chat", at_third=ask_base)
        asked["thread"].join()
        assert usage["completion_tokens"] == TOKENS and len(times) > 3
        assert asked["out"]["result"]["model"] == "base"
        assert asked["out"]["end"] < times[-1]  # answered while chat still streamed
        until(c, {"chat": "loaded", "base": "unloaded"})
        assert complete(c, "base")["model"] == "base"
        assert states(c) == {"chat": "unloaded", "base": "loaded"}
        assert metric(c, 'doel_model_loads_total{model="base"}') == 2
        assert metric(c, 'doel_model_loads_total{model="chat"}') == 1


def test_a_damaged_bundle_and_a_gguf_folder_among_good_ones(pair, tmp_path, monkeypatch, capsys):
    """doel-serve chat --models DIR: the GGUF folder is skipped in one line; the damaged bundle
    (32 bytes of its weights flipped: sizes match, the sha256 does not) fails at its load with
    a 503 saying so, and chat and base are served as before."""
    import uvicorn

    from doel.serve.cli import main

    chat, base = pair
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(base, models / "base")
    shutil.copytree(base, models / "broken")
    data = models / "broken" / "model.onnx.data"
    with open(data, "r+b") as f:
        f.seek(data.stat().st_size // 2)
        chunk = f.read(32)
        f.seek(-32, 1)
        f.write(bytes(b ^ 0xFF for b in chunk))
    (models / "llama-gguf").mkdir()
    manifest = {"format": "doel-export", "kind": "gguf", "quant": "q8_0", "gguf": "m.gguf"}
    (models / "llama-gguf" / "manifest.json").write_text(json.dumps(manifest))
    seen = {}
    monkeypatch.setattr("doel.serve.cli.check_port", lambda host, port: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app))
    main([str(chat), "--models", str(models), "--threads", "1", "--allowed-host", "testserver"])
    skipped = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(skipped) == 1 and "llama-gguf holds a GGUF for llama.cpp" in skipped[0]
    with TestClient(seen["app"]) as c:
        ready(c)
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["chat", "base", "broken"]
        r = c.post("/v1/completions", json={"model": "broken", "prompt": PROMPT})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("the bundle is damaged: ") and "\n" not in message
        assert "model.onnx.data does not match the sha256" in message
        assert states(c) == {"chat": "loaded", "base": "unloaded", "broken": "failed"}
        assert complete(c, "base")["model"] == "base" and complete(c)["model"] == "chat"
        assert metric(c, 'doel_model_state{model="broken",state="failed"}') == 1
        again = c.post("/v1/completions", json={"model": "broken", "prompt": PROMPT})
        assert again.status_code == 503 and again.json()["error"]["message"] == message


def test_health_names_no_model_when_a_key_guards_the_api(pair):
    """/health answers without the key; the model names are behind it, in /metrics."""
    with TestClient(app_of(pair, api_key="k")) as c:
        assert ready(c).get("/health").json() == {"status": "ok"}
        text = c.get("/metrics", headers={"Authorization": "Bearer k"}).text
        assert 'doel_model_state{model="base",state="unloaded"} 1' in text


def test_the_playground_picks_the_model_from_the_servers_list(pair):
    """The page asks /v1/models, shows a picker when there are several, names the one picked
    in each request, and switches to chat mode for a chat model."""
    with TestClient(app_of(pair)) as c:
        page = ready(c).get("/").text
    assert '<select id="model-choice">' in page and 'fetch("/v1/models"' in page
    assert 'b.model = $("model-choice").value' in page  # both modes' bodies are body()'s
    assert '$(card.chat ? "mode-chat" : "mode-completion").checked = true' in page
    assert '$("models").hidden = models.length < 2' in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "error: no bundle to serve (none was given)"),
        (["--models", "{empty}"], "holds no bundle"),
        (["{chat}", "{chat}"], "two bundles are named 'chat'"),
        (["{chat}", "{base}", "--model-name", "x"], "--model-name names one bundle"),
        (["{chat}", "--keep-alive", "-2"], "--keep-alive must be 0 or more seconds, or -1"),
        (["{chat}", "--max-models", "0"], "--max-models must be 1 or more"),
    ],
)
def test_doel_serve_says_in_one_line_what_is_wrong_with_its_models(pair, tmp_path, args, message):
    from doel.serve.cli import main

    chat, base = pair
    names = {"chat": chat, "base": base, "empty": tmp_path}
    with pytest.raises(SystemExit, match=re.escape(message)):
        main([a.format(**names) for a in args])
