"""`doel-serve`: refuses a folder that is not a bundle before opening a port, binds loopback by
default, takes the API key from the environment, says in one line that its port is taken, and
serves a real uvicorn process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from doel.serve.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_a_folder_that_is_not_a_bundle_is_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="error: .* has no manifest.json"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match="--threads must be 0 or more"):
        main([str(tmp_path), "--threads", "-1"])
    with pytest.raises(SystemExit, match="--slots must be 1 or more"):
        main([str(tmp_path), "--slots", "0"])
    with pytest.raises(SystemExit, match="--draft-tokens must be 0 or more"):
        main([str(tmp_path), "--draft-tokens", "-2"])


def test_bundles_may_come_between_flags(tiny_bundle, tmp_path):
    """`doel-serve A --threads 2 B` names two bundles: B is checked (and refused here, as a
    folder with no manifest), not taken for a stray argument."""
    with pytest.raises(SystemExit, match=f"error: {tmp_path} has no manifest.json"):
        main([str(tiny_bundle), "--threads", "2", str(tmp_path)])


def test_a_gguf_folder_is_one_line_that_says_how_to_run_it(tmp_path):
    """A folder written by `doel-export --format gguf`: no traceback, the line names the file
    and what runs it."""
    (tmp_path / "model-q8_0.gguf").write_bytes(b"GGUF")
    manifest = {"format": "doel-export", "kind": "gguf", "quant": "q8_0", "gguf": "model-q8_0.gguf"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    cmd = [sys.executable, "-m", "doel.serve", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {tmp_path} holds a GGUF for llama.cpp (model-q8_0.gguf)")
    assert "llama-server or Ollama" in lines[0] and "doel-export CHECKPOINT" in lines[0]
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(SystemExit, match="error: .* format version 99, newer than this doel"):
        main([str(tmp_path)])


@pytest.fixture
def any_port(monkeypatch):
    """No port check: these tests never serve, and 8000 may be another server's here."""
    monkeypatch.setattr("doel.serve.cli.check_port", lambda host, port: None)


def test_loopback_by_default_and_the_key_from_the_environment(tiny_bundle, monkeypatch, any_port):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw, app=app))
    monkeypatch.setenv("DOEL_API_KEY", "k1")
    main([str(tiny_bundle), "--port", "9999"])
    assert seen["host"] == "127.0.0.1" and seen["port"] == 9999
    guard = seen["app"].middleware_stack or seen["app"].build_middleware_stack()
    while not hasattr(guard, "api_key"):
        guard = guard.app
    assert guard.api_key == "k1"


@pytest.fixture
def never_serve(monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the server started"))
    monkeypatch.delenv("DOEL_API_KEY", raising=False)


def test_an_empty_or_unreadable_key_is_a_one_line_error(
    tiny_bundle, tmp_path, monkeypatch, never_serve
):
    (tmp_path / "empty").write_text("\n")
    cases = [
        ([], "DOEL_API_KEY is empty; give a key, or unset it to serve without one"),
        (["--api-key", " "], "--api-key is empty"),
        (["--api-key-file", str(tmp_path / "empty")], f"{tmp_path / 'empty'} is empty"),
        (["--api-key-file", str(tmp_path / "none")], "cannot read --api-key-file .*none"),
        (["--api-key-file", str(tmp_path / "none"), "--api-key", "k"], "give .* not both"),
    ]
    monkeypatch.setenv("DOEL_API_KEY", "")
    for args, message in cases:
        with pytest.raises(SystemExit, match=f"^error: {message}") as e:
            main([str(tiny_bundle), *args])
        assert "\n" not in str(e.value)


def test_a_non_loopback_address_without_a_key_is_warned_about(
    tiny_bundle, monkeypatch, capsys, any_port
):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.delenv("DOEL_API_KEY", raising=False)
    main([str(tiny_bundle), "--host", "0.0.0.0"])
    assert seen["host"] == "0.0.0.0"
    assert "warning: serving on 0.0.0.0 without an API key" in capsys.readouterr().err
    for quiet in (
        ["--host", "127.0.0.1"],
        ["--host", "::1"],
        ["--host", "0.0.0.0", "--api-key", "k"],
    ):
        main([str(tiny_bundle), *quiet])
        assert "without an API key" not in capsys.readouterr().err


def test_help_shows_every_limit_with_its_default():
    text = " ".join(build_parser().format_help().split())
    for flag, default in [
        ("--timeout-read S", "(default 30)"),
        ("--timeout-keep-alive S", "(default 5)"),
        ("--max-connections N", "(default 512)"),
        ("--max-headers N", "(default 256)"),
        ("--max-body-bytes MAX_BODY_BYTES", "(default 1 MiB)"),
        ("--max-queue MAX_QUEUE", "(default 16)"),
        ("--slots SLOTS", "(default 4)"),
    ]:
        after = text.split(f"{flag} ", 1)[1]
        assert after.split(" --", 1)[0].endswith(default), (flag, after[:200])
    for flag in ("--api-key-file PATH", "--allowed-host NAME", "--docs", "--cors-origin"):
        assert flag in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _held(family=socket.AF_INET, host="127.0.0.1", reuse=True) -> socket.socket:
    """A listening socket on a free port, as another server holds it (uvicorn sets
    SO_REUSEADDR)."""
    s = socket.socket(family)
    try:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen()
    except OSError:
        s.close()
        raise
    return s


def test_a_port_in_use_is_one_line_and_exit_1_before_anything_starts(tiny_bundle):
    """It once printed six uvicorn lines, "Application startup complete." among them, then
    "[Errno 98] address already in use", and exited 3."""
    with _held() as held:
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "doel.serve", str(tiny_bundle), "--port", str(port)]
        env = {k: v for k, v in os.environ.items() if k != "DOEL_API_KEY"}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr == (
        f"error: port {port} on 127.0.0.1 is in use (by another server?); choose another with "
        f"--port\n"
    )


def test_the_port_check_binds_as_uvicorn_does(tiny_bundle, never_serve):
    """Held without SO_REUSEADDR, on IPv6, on every address: each is a one-line error."""
    with _held(reuse=False) as held:
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=f"^error: port {port} on 127.0.0.1 is in use"):
            main([str(tiny_bundle), "--port", str(port)])
        with pytest.raises(SystemExit, match=f"^error: port {port} on 0.0.0.0 is in use"):
            main([str(tiny_bundle), "--port", str(port), "--host", "0.0.0.0", "--api-key", "k"])
    try:
        held = _held(socket.AF_INET6, "::1")
    except OSError:  # no IPv6 loopback on this machine
        held = None
    if held is not None:
        with held:
            port = held.getsockname()[1]
            with pytest.raises(SystemExit, match=f"^error: port {port} on ::1 is in use"):
                main([str(tiny_bundle), "--port", str(port), "--host", "::1"])
    with pytest.raises(SystemExit, match="^error: --port must be between 0 and 65535, not 70000"):
        main([str(tiny_bundle), "--port", "70000"])
    with pytest.raises(SystemExit, match="^error: cannot listen on 192.0.2.1 port 0: "):
        main([str(tiny_bundle), "--port", "0", "--host", "192.0.2.1", "--api-key", "k"])


def test_a_real_server_answers_completions_and_streams(tiny_bundle):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "doel.serve",
        str(tiny_bundle),
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "DOEL_API_KEY"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited: {proc.communicate()[1][-2000:]}")
            assert time.monotonic() < end, "the server did not become healthy in 60 s"
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        req = {"prompt": "নদীর ধারে", "max_tokens": 8, "temperature": 0}
        whole = httpx.post(f"{base}/v1/completions", json=req).json()
        with httpx.stream("POST", f"{base}/v1/completions", json={**req, "stream": True}) as r:
            lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        text = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
        assert text == whole["choices"][0]["text"] and whole["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)  # reaps it and closes the pipe


def test_the_demo_prints_no_playground_address_that_dies_with_it(tiny_bundle, capsys):
    """Without --serve the demo's server stops as the demo ends: it printed the playground's
    address all the same, dead by the time it was read."""
    from doel.pipeline.demo import serve_demo

    body = serve_demo(tiny_bundle, ask=lambda url: {"url": url})
    out = capsys.readouterr().out
    playground = [line for line in out.splitlines() if line.startswith("playground:")]
    assert body["url"].startswith("http://127.0.0.1:")
    assert playground == [
        f"playground: `doel-serve {tiny_bundle}` serves it (or the demo with --serve)"
    ]
