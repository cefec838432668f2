"""ASGI middleware in front of every route: the Host name (`AllowedHosts`); the header count, the
API key (from Authorization or x-api-key) and so the tenant (`Keys`), each client's request rate
(`ClientRates`: past it, a 429 before anything is read or routed), the body-size limit and each
client's body rate (`Guard`, with `BodyBudget`: a large body waits, unread, for its client's
turn).

It is plain ASGI rather than FastAPI dependencies so that it also covers 404s, the OpenAPI page
and bodies sent without a Content-Length (chunked), which are read up to the limit and replayed.
"""

from __future__ import annotations

import asyncio

from doel.serve.edge.ratelimit import HOLD, PROBE_PATHS, BodyBudget, ClientRates
from doel.serve.edge.refusal import send_error
from doel.serve.edge.tenants import Keys
from doel.serve.playground import FONT_PATH
from doel.serve.settings import Settings

# Answered without a key: probes, and the playground page and its font (they hold no data; the
# page's requests carry the key typed into it).
OPEN_PATHS = ("/health", "/", FONT_PATH)
# Passed without a key, as vLLM and llama.cpp do: a browser's CORS preflight carries none (the
# CORS middleware, outside this one, answers it when --cors-origin is set); no route answers
# OPTIONS otherwise (405).
OPEN_METHODS = ("OPTIONS",)
# Where the Guard puts the tenant of a request that passed the key check; absent without keys.
TENANT = "doel.tenant"


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str:
    """The name in a Host header, without its port: '[::1]:8000' → '::1', 'LocalHost.' →
    'localhost'."""
    name = value.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return name.rstrip(".")


class AllowedHosts:
    """Answers only requests whose Host names one of `hosts` (any port; "*": any host).

    Against DNS rebinding: a page on evil.example whose name its owner re-points to 127.0.0.1
    reaches a server on loopback as its own origin, so the browser lets it generate and read
    /metrics unless the server refuses a Host that is not its own. The refusal is a 421
    (Misdirected Request, RFC 9110 15.5.20: the server will not answer for that authority) rather
    than a 400, as the request itself is well-formed; more than one Host is a 400 (RFC 9112 3.2).
    """

    def __init__(self, app, hosts: tuple[str, ...] | None = None):
        self.app = app
        self.hosts = None if hosts is None or "*" in hosts else {host_name(h) for h in hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.hosts is None:
            return await self.app(scope, receive, send)
        given = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        if len(given) > 1:
            why = f"the request has {len(given)} Host headers; send one"
            return await send_error(send, 400, why, "invalid_request_error")
        name = host_name(given[0]) if given else None  # none: HTTP/1.0, never a browser's
        if name is not None and name not in self.hosts:
            shown = ", ".join(sorted(self.hosts))
            why = (
                f"this server does not answer for the host {name[:100]!r}, only for {shown}; "
                f"start it with --allowed-host {name[:100]} to add it"
            )
            return await send_error(send, 421, why, "invalid_request_error")
        return await self.app(scope, receive, send)


class Guard:
    def __init__(
        self,
        app,
        api_key: str | None = None,
        max_body_bytes: int = Settings.max_body_bytes,
        max_headers: int = Settings.max_headers,
        keys: dict[str, str] | None = None,
        body_rate: int = Settings.client_body_rate,
        request_rate: float = Settings.client_request_rate,
    ):
        """`api_key`: one key (one tenant); `keys`: {key: tenant}; `body_rate`: bytes of bodies
        a client may send a second, 0 for any; `request_rate`: requests a client may send a
        second, 0 for any."""
        self.app, self.api_key, self.limit = app, api_key, max_body_bytes
        self.max_headers = max_headers
        table = keys or ({api_key: "#1"} if api_key else {})
        self.key = Keys(table) if table else None
        # A burst of the largest body accepted: one such body passes at once.
        self.budget = BodyBudget(body_rate, max(max_body_bytes, 1)) if body_rate > 0 else None
        self.requests = ClientRates(request_rate) if request_rate > 0 else None

    def _refusal(self, scope) -> tuple[int, str, str, list] | None:
        """Why the request does not pass the key check (status, message, type, headers); None
        when it passes, its tenant then in scope[TENANT]. The key comes as `Authorization:
        Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's); both, they must agree."""
        given = [v for k, v in scope["headers"] if k == b"authorization"]
        plain = [v for k, v in scope["headers"] if k == b"x-api-key"]
        for name, values in (("Authorization", given), ("x-api-key", plain)):
            if len(values) > 1:  # which one counts would depend on who reads them: refuse both
                why = f"the request has {len(values)} {name} headers; send one"
                return 400, why, "invalid_request_error", []
        scheme, _, token = (given[0] if given else b"").partition(b" ")
        token = token.strip(b" \t")
        if plain and given and (scheme.lower() != b"bearer" or token != plain[0].strip(b" \t")):
            why = "the request's Authorization and x-api-key headers differ; send one key"
            return 400, why, "invalid_request_error", []
        if plain:
            scheme, token = b"bearer", plain[0].strip(b" \t")
        # The scheme in any case (RFC 9110 11.1); the keys compared in constant time, so that
        # none can be guessed by timing.
        tenant = self.key.tenant(token)
        if scheme.lower() == b"bearer" and tenant is not None:
            scope[TENANT] = tenant
            return None
        why = "missing or wrong API key: send Authorization: Bearer KEY (or x-api-key: KEY)"
        return 401, why, "authentication_error", [(b"www-authenticate", b"Bearer")]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if len(scope["headers"]) > self.max_headers:  # h11 caps their bytes (16 KiB), not count
            n = len(scope["headers"])
            why = f"the request has {n} headers; at most {self.max_headers} are accepted"
            return await send_error(send, 431, why, "invalid_request_error")
        headers = dict(scope["headers"])
        guarded = scope["path"] not in OPEN_PATHS and scope["method"] not in OPEN_METHODS
        refused = self._refusal(scope) if self.key and guarded else None
        # Over its rate, a client's request (a wrong key's too: it counts for its address) is
        # refused now, before its body is read or anything is routed.
        rate = self.requests.of(scope["path"]) if self.requests is not None else None
        if rate is not None and (after := rate.take(self._client(scope))):
            probe = f" to {scope['path']}" if scope["path"] in PROBE_PATHS else ""
            why = (
                f"this client sent over {rate.rate:g} requests a second{probe} "
                f"(--client-request-rate); retry after {after} s"
            )
            retry = [(b"retry-after", str(after).encode())]
            scope[HOLD] = after  # the connection reads no more until then
            return await send_error(send, 429, why, "rate_limit_exceeded", retry)
        if refused:
            return await send_error(send, *refused)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await send_error(send, 413, self._too_big(), "invalid_request_error")
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) > self.limit:
                    return await send_error(send, 413, self._too_big(), "invalid_request_error")
            receive = _replay(body, receive)
            length = b"%d" % len(body)
        if self.budget is not None and length is not None and guarded:
            if not await self._paced(scope, int(length), send):
                return  # refused: a 429 was sent
        return await self.app(scope, receive, send)

    @staticmethod
    def _client(scope):
        """Who sent the request: its key's tenant once the key check passed, else its address."""
        return scope.get(TENANT) or ("address", (scope.get("client") or ("?",))[0])

    async def _paced(self, scope, size: int, send) -> bool:
        """Wait for the client's body rate (`BodyBudget`): True once the body may be read,
        False when a 429 was sent for a body that would wait too long."""
        client = self._client(scope)
        wait = self.budget.charge(client, size)
        if wait is None:
            after = self.budget.retry_after(client, size)
            why = (
                f"this client's request bodies are over {self.budget.rate:,.0f} bytes a second "
                f"(--client-body-rate); retry after {after} s"
            )
            headers = [(b"retry-after", str(after).encode())]
            await send_error(send, 429, why, "rate_limit_exceeded", headers)
            return False
        if wait > 0:
            await asyncio.sleep(wait)
        return True

    def _too_big(self) -> str:
        return f"the request body is over the limit of {self.limit} bytes"


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the real channel: disconnects still arrive

    return replay
