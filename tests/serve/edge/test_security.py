"""Browsers and keys on a live `doel-serve` (loopback): CORS works together with an API key (the
preflight passes the key check, a 401 carries the CORS headers so a page can read it); bound to
loopback, only loopback Host names (and --allowed-host ones) are answered, against DNS rebinding;
the key comes from a file, its scheme in any case, and two Authorization headers are refused;
numbers and booleans are strict ("8" and true are not numbers); a 429 says it is a rate limit;
/docs and /openapi.json only with --docs; one line says the server is ready, and where."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest
from live_server import live_server

KEY = "k-3f9a"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def keyed(tiny_bundle, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    (folder / "key").write_text(f"{KEY}\n")  # as `echo KEY > key` writes it
    args = ("--api-key-file", str(folder / "key"), "--cors-origin", ORIGIN)
    with live_server(tiny_bundle, folder, *args) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


@pytest.fixture(scope="module")
def http(keyed):
    with httpx2.Client(base_url=keyed.url, trust_env=False, timeout=30) as c:
        yield c


def test_a_preflight_passes_the_key_check(http):
    ask = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = http.options("/v1/completions", headers=ask)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    other = http.options("/v1/completions", headers={**ask, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_a_401_carries_the_cors_headers_and_the_key_still_guards(http):
    body = {"prompt": "নদী", "max_tokens": 2}
    r = http.post("/v1/completions", json=body, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    assert r.json()["error"]["type"] == "authentication_error"
    ok = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    r = http.post("/v1/completions", json=body, headers=ok)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # An OPTIONS that is not a preflight reaches no handler: 405, nothing read without the key.
    r = http.options("/v1/models")
    assert r.status_code == 405 and "data" not in r.text


@pytest.fixture(scope="module")
def open_server(tiny_bundle, tmp_path_factory):
    """No key, on loopback, one more Host name allowed; one slot and no queue (429 at once);
    the API's pages on."""
    args = ("--allowed-host", "my.box", "--slots", "1", "--max-queue", "0", "--docs")
    with live_server(tiny_bundle, tmp_path_factory.mktemp("open"), *args) as s:
        yield s
    assert "Traceback" not in s.log_text(), s.log_text()[-3000:]


@pytest.mark.parametrize("path", ["/metrics", "/v1/models", "/health", "/"])
@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example"])
def test_a_rebound_host_name_is_refused_with_421(open_server, path, host):
    port = open_server.url.rsplit(":", 1)[1]
    headers = {"Host": host.format(port=port)}
    r = httpx2.get(open_server.url + path, headers=headers, trust_env=False)
    assert r.status_code == 421, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 421
    assert "--allowed-host" in error["message"] and "doel_" not in r.text


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:{port}", "LocalHost:{port}", "127.0.0.1", "127.0.0.1:{port}",
     "[::1]", "[::1]:{port}", "my.box", "my.box:{port}"],
)  # fmt: skip
def test_loopback_names_and_allowed_hosts_are_answered(open_server, host):
    port = open_server.url.rsplit(":", 1)[1]
    r = httpx2.get(
        f"{open_server.url}/metrics", headers={"Host": host.format(port=port)}, trust_env=False
    )
    assert r.status_code == 200 and "doel_requests_total" in r.text


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_key_from_its_file_with_the_bearer_scheme_in_any_case(http, scheme):
    r = http.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200 and r.json()["data"]


@pytest.mark.parametrize("given", ["Basic " + KEY, KEY, f"Bearer {KEY}x", "Bearer", ""])
def test_another_scheme_or_key_is_401(http, given):
    r = http.get("/v1/models", headers={"Authorization": given})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer wrong"])
def test_two_authorization_headers_are_refused(http, second):
    headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", second)]
    for first_last in (headers, headers[::-1]):
        r = http.get("/v1/models", headers=first_last)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "2 Authorization headers; send one" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", "8", "max_tokens: Input should be a valid integer"),
        ("max_tokens", True, "max_tokens: Input should be a valid integer"),
        ("max_tokens", 8.0, "max_tokens: Input should be a valid integer"),
        ("temperature", "0.5", "temperature: Input should be a valid number"),
        ("temperature", True, "temperature: Input should be a valid number"),
        ("seed", "1", "seed: Input should be a valid integer"),
        ("stream", "true", "stream: Input should be a valid boolean"),
        ("stream", 1, "stream: Input should be a valid boolean"),
    ],
)
def test_strings_and_booleans_are_not_numbers(open_server, field, value, message):
    body = {"prompt": "নদী", "max_tokens": 2, field: value}
    r = httpx2.post(f"{open_server.url}/v1/completions", json=body, trust_env=False)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == field


def test_an_integer_is_a_number_for_a_float_field(open_server):
    body = {"prompt": "নদী", "max_tokens": 2, "temperature": 1, "top_p": 1, "presence_penalty": 0}
    r = httpx2.post(f"{open_server.url}/v1/completions", json=body, trust_env=False)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_a_full_queue_is_429_with_a_rate_limit_type(open_server):
    # One slot and no queue: of 6 requests sent together, all but the one decoding are refused.
    body = {"prompt": "নদী", "max_tokens": 60, "temperature": 0}

    def post(_):
        return httpx2.post(f"{open_server.url}/v1/completions", json=body, trust_env=False)

    for _ in range(5):  # sent together they overlap, unless the machine stalls the first ones
        with ThreadPoolExecutor(6) as pool:
            refused = [r for r in pool.map(post, range(6)) if r.status_code == 429]
        if refused:
            break
    assert refused, "no request was refused with one slot and no queue"
    error = refused[0].json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == 429
    assert refused[0].headers["retry-after"] == "1"


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_pages_are_off_unless_asked_for(http, open_server, path):
    assert http.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    r = httpx2.get(open_server.url + path, trust_env=False)
    assert r.status_code == 200 and ("/v1/completions" in r.text or "<html" in r.text.lower())


def test_one_line_says_it_is_ready_with_the_api_and_playground_addresses(keyed, open_server):
    for server, key in ((keyed, "; key required"), (open_server, "")):
        lines = [x for x in server.log_text().splitlines() if "ready" in x]
        assert lines == [
            f"doel-serve: serve-bundle ready at {server.url}/v1 (OpenAI API{key}), "
            f"playground at {server.url}/"
        ]
