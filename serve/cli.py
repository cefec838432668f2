"""`doel-serve BUNDLE [BUNDLE ...]` or `doel-serve --models DIR` (or `python -m doel.serve`): the
HTTP server on export bundles, one or several (serve/core/models.py: the first is loaded at once,
the others on their first request, each let go after --keep-alive idle seconds).

It binds 127.0.0.1 unless told otherwise; an API key (`--api-key-file`, DOEL_API_KEY or
`--api-key`) guards every route but /health and the playground page; binding another address
without one is warned about. A key file may hold several keys, each a tenant whose cached
prefixes no other tenant reuses (`--prefix-cache`). The bundle and the keys
are checked before the port opens, so a wrong folder or an empty key is a one-line error, and so
is the port, tried before anything starts (`check_port`: a port in use once printed uvicorn's
startup lines, "Application startup complete." among them, before its error); the bundle's
files are hashed against its manifest while the model loads (`Verification`), a damaged one
ending the server with one line.
Connections get their limits (read deadline, keep-alive, a cap, header count) from uvicorn's
h11 protocol with those added (`protocol_class`).
Heavy imports happen inside `main`, so a missing extra prints the `pip install` line that fixes
it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

from doel.contracts.checksums import add_flag
from doel.contracts.cpu import this_class
from doel.serve.edge.ratelimit import BURST_SECONDS, MAX_BODY_WAIT, PROBE_FACTOR  # stdlib
from doel.serve.edge.tenants import MODES, KeyFileError, parse_keys
from doel.serve.settings import Settings  # stdlib only: every default below is its field's

EXTRA_HINT = "pip install 'doel[serve]'"
KEY_ENV = "DOEL_API_KEY"
FD_RESERVE = 64  # descriptors kept for the model's files, the log and the listening socket


def mib(n: int) -> str:
    """A byte count as help shows it: '1 MiB' for a whole number of MiB, else the bytes."""
    return f"{n >> 20} MiB" if n and n % (1 << 20) == 0 else f"{n} bytes"


def setting(group, flag: str, help: str, **kw) -> None:
    """A flag for a Settings field (`--max-queue`: `max_queue`): its type and default are the
    field's."""
    default = getattr(Settings, flag.removeprefix("--").replace("-", "_"))
    group.add_argument(flag, type=type(default), default=default, help=help, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="doel-serve",
        description="OpenAI-compatible completions over export bundles, on CPU, without torch",
    )
    _serving_flags(p)
    _client_flags(p)
    _connection_flags(p.add_argument_group("connection limits"))
    return p


def _serving_flags(p: argparse.ArgumentParser) -> None:
    """The bundle, where it is served, its keys, and how many requests it decodes and queues."""
    p.add_argument(
        "bundle",
        nargs="*",
        metavar="BUNDLE",
        help="a folder written by doel-export; several: one server for them all, the first "
        "answering requests that name no model",
    )
    p.add_argument(
        "--models",
        metavar="DIR",
        help="serve every bundle folder in DIR as well (a folder that is not one, a GGUF's "
        "among them, is named in one line and skipped)",
    )
    setting(
        p,
        "--keep-alive",
        f"seconds a model stays loaded after its last request, then it is unloaded and its "
        f"memory given back (default {Settings.keep_alive:g}; -1: never)",
        metavar="S",
    )
    setting(
        p,
        "--max-models",
        "models loaded at once; loading one more first unloads the least recently used idle "
        "one (default %(default)s)",
        metavar="N",
    )
    setting(
        p,
        "--load-retry",
        "seconds before a model whose load failed (memory, I/O) is tried again by its next "
        "request, doubled for each failure in a row up to 3 times it; a damaged bundle once its "
        "files change (default %(default)s; 0: every request)",
        metavar="S",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    setting(p, "--threads", "ONNX Runtime threads (0: per core)")
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help=f"require 'Authorization: Bearer KEY' on all but /health, the keys read from PATH, "
        f"one a line, each optionally named 'NAME:KEY'; each name (or unnamed key) is a tenant "
        f"(or ${KEY_ENV}, or --api-key: one key, which every local user can see in the process "
        f"list)",
    )
    p.add_argument("--api-key", help="the key itself (prefer --api-key-file)")
    p.add_argument(
        "--model-name",
        help="the model's id in the API, one bundle only (default: its folder's name)",
    )
    setting(p, "--slots", "requests decoded together (default %(default)s)")
    setting(
        p,
        "--kv-positions",
        "KV cache positions the slots share, taken as sequences grow and given back as they "
        "end, the youngest preempted when full; nothing is reserved for max_tokens (default "
        "%(default)s: slots x the model's context, as far as half the memory available allows)",
        metavar="N",
    )
    setting(
        p,
        "--step-tokens",
        "prompt tokens plus decoding rows in one step: bounds how long a new prompt holds the "
        "running streams (default %(default)s)",
        metavar="N",
    )
    setting(
        p,
        "--prefix-keep",
        "seconds a finished request's cache is kept for its next turn (default %(default)s)",
        metavar="SECONDS",
    )
    setting(
        p,
        "--draft-tokens",
        "ids a lone stream drafts from its prompt and output and verifies in one run "
        "(prompt lookup); 0: none (default %(default)s)",
        metavar="N",
    )
    setting(p, "--max-queue", "waiting requests before 429 (default %(default)s)")


def _client_flags(p: argparse.ArgumentParser) -> None:
    """What one request and one client may send, and what the server answers for whom."""
    setting(
        p,
        "--max-body-bytes",
        f"request body size; more is 413 (default {mib(Settings.max_body_bytes)})",
    )
    setting(
        p,
        "--client-body-rate",
        f"bytes of request bodies one client (API key's tenant, else address) may send a "
        f"second; a large body past it waits its turn, one that would wait over "
        f"{MAX_BODY_WAIT:g} s is 429 (default {mib(Settings.client_body_rate)}; 0: no limit)",
        metavar="BYTES",
    )
    setting(
        p,
        "--client-request-rate",
        f"requests one client (API key's tenant, else address) may send a second, with a "
        f"burst of {BURST_SECONDS:g} s of them; past it, 429 with Retry-After before the body is "
        f"read (/health and /metrics apart, at {PROBE_FACTOR}x; default %(default)s; 0: no "
        "limit)",
        metavar="N",
    )
    p.add_argument(
        "--cors-origin", action="append", default=[], help="allow this browser origin (repeat)"
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host is NAME, any port (repeat; '*': any). Bound to "
        "loopback, only localhost, 127.0.0.1 and [::1] are answered otherwise (DNS rebinding)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (off: the pages load scripts from a CDN)",
    )
    setting(
        p,
        "--prefix-cache",
        "per-tenant: a cached prompt prefix is reused only for the tenant (API key) that sent "
        "it, and a request's cache_salt; shared: for every tenant; off: never (default "
        "%(default)s; without keys there is one tenant)",
        choices=MODES,
    )
    setting(
        p,
        "--max-messages",
        "messages in one chat request; more is refused with 400 (default %(default)s)",
        metavar="N",
    )
    _request_bounds(p)
    add_flag(
        p,
        "serve the bundle without checking its files against the sha256 its manifest "
        "records (checked while the model loads otherwise)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the server's log level (default info)",
    )


def _request_bounds(p: argparse.ArgumentParser) -> None:
    """What one request may make the server hold and compile (serve/edge/bounds.py); past each,
    400."""
    for flag, metavar, what in (
        ("--max-tools", "N", "functions in one request's tools; more"),
        ("--max-tool-schema-bytes", "BYTES", "bytes of one tool's parameters schema; more"),
        ("--max-input-items", "N", "items in one /v1/responses or /v1/embeddings input; more"),
        ("--max-input-bytes", "BYTES", "bytes of the texts of one such input; more"),
        ("--compile-timeout", "S", "seconds a schema or grammar may take to compile; longer"),
    ):
        setting(p, flag, f"{what} is refused with 400 (default %(default)s)", metavar=metavar)


def _connection_flags(limits) -> None:
    """The limits a connection gets below HTTP (`protocol_class`), and its header count."""
    limits.add_argument(
        "--timeout-read",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to receive a whole request, head and body, from its first byte or the "
        "connection's opening; then 408 and close (default 30)",
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an idle connection is kept between requests (default 5)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=512,
        metavar="N",
        help="open connections; a new one over it is answered 503 (default 512)",
    )
    setting(
        limits,
        "--write-timeout",
        "seconds one write of a streamed answer may wait for a client that stopped reading; "
        "then the answer ends and its slot is freed (default %(default)s)",
        metavar="S",
    )
    setting(
        limits,
        "--max-headers",
        "headers in a request; more is refused with 431 (default %(default)s)",
        metavar="N",
    )


def key_file(path: str) -> dict[str, str]:
    """{key: tenant} from --api-key-file (`parse_keys`); a one-line error otherwise (a
    two-line file once made every key fail, silently)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"error: cannot read --api-key-file {path}: {e}")
    try:
        return parse_keys(text, path)
    except KeyFileError as e:
        sys.exit(f"error: {e}")


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key or $DOEL_API_KEY (--api-key-file: `key_file`); an empty one is an
    error rather than a server without a key."""
    if args.api_key_file and args.api_key is not None:
        sys.exit("error: give --api-key-file or --api-key, not both")
    if args.api_key_file:
        return None
    if args.api_key is not None:
        key, where = args.api_key, "--api-key"
    elif KEY_ENV in os.environ:
        key, where = os.environ[KEY_ENV], KEY_ENV
    else:
        return None
    key = key.strip()  # a file's newline; a client cannot send edge spaces in a header anyway
    if not key:
        sys.exit(f"error: {where} is empty; give a key, or unset it to serve without one")
    return key


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, extra: list[str]) -> tuple[str, ...] | None:
    """The Host names answered: on loopback (or with --allowed-host) the loopback names, the
    bound address and those given; None (any) on another address without --allowed-host."""
    from doel.serve.edge.guard import LOOPBACK_HOSTS

    if "*" in extra or not (is_loopback(host) or extra):
        return None
    return (*LOOPBACK_HOSTS, host, *extra)


def base_url(host: str, port: int) -> str:
    """Where a browser on this machine reaches the server (all addresses: via loopback)."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def check_port(host: str, port: int) -> None:
    """Exits with one line unless every address `host` names can be bound on `port`, tried as
    uvicorn's asyncio server binds (getaddrinfo with AI_PASSIVE, SO_REUSEADDR, IPv6 only on an
    IPv6 socket), then released for it: uvicorn would load the app and print its startup before
    failing, and exit 3. A host that is not this machine's is one line too."""
    if not 0 <= port <= 65535:
        sys.exit(f"error: --port must be between 0 and 65535, not {port}")
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        sys.exit(f"error: cannot bind --host {host}: {e.strerror}")
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    sys.exit(
                        f"error: port {port} on {address[0]} is in use (by another server?); "
                        f"choose another with --port"
                    )
                sys.exit(f"error: cannot listen on {address[0]} port {port}: {e.strerror}")


def log_config(level: str, floods) -> dict:
    """uvicorn's logging, plus our `doel` logger on its handler and the flood filter on the
    loggers that write a line (or a traceback) per socket."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["filters"] = {"floods": {"()": lambda: floods}}
    cfg["loggers"]["uvicorn.error"]["filters"] = ["floods"]
    quiet = {"handlers": ["default"], "propagate": False, "filters": ["floods"]}
    cfg["loggers"]["asyncio"] = {**quiet, "level": "WARNING"}
    cfg["loggers"]["doel"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


def check_numbers(args: argparse.Namespace) -> None:
    """Exits with one line for a count, rate or timeout out of its range."""
    rates = ("client_body_rate", "client_request_rate")
    waits = ("prefix_keep", "load_retry")
    counts0 = ("threads", "max_queue", "max_body_bytes", "kv_positions", "draft_tokens")
    for name in (*counts0, *waits, *rates):
        if getattr(args, name) < 0:
            sys.exit(f"error: --{name.replace('_', '-')} must be 0 or more")
    bounds = ("max_tools", "max_tool_schema_bytes", "max_input_items", "max_input_bytes")
    counts = ("slots", "step_tokens", "max_connections", "max_headers", "max_messages")
    counts += ("max_models",)
    for name in (*counts, *bounds):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} must be 1 or more")
    for name in ("timeout_read", "timeout_keep_alive", "compile_timeout", "write_timeout"):
        if not 0 < getattr(args, name) <= 3600:
            sys.exit(f"error: --{name.replace('_', '-')} must be between 0 and 3600 seconds")
    if args.keep_alive < 0 and args.keep_alive != -1:
        sys.exit("error: --keep-alive must be 0 or more seconds, or -1 (never unload)")


def bundle_folders(args: argparse.Namespace, read_bundle, error) -> list[tuple]:
    """(folder, its bundle as read_bundle read it) of each to serve: each BUNDLE (one that is not a
    bundle is a one-line error), then each bundle folder in --models DIR, by name (one that is
    not is skipped, in one line)."""
    folders = []
    for folder in args.bundle:
        try:
            folders.append((folder, read_bundle(folder)))
        except error as e:
            sys.exit(f"error: {e}")
    if args.models is not None:
        if not Path(args.models).is_dir():
            sys.exit(f"error: --models {args.models} is not a folder; give the folder of bundles")
        for sub in sorted(p for p in Path(args.models).iterdir() if p.is_dir()):
            try:
                folders.append((str(sub), read_bundle(sub)))
            except error as e:
                print(f"warning: skipping {sub}: {e}", file=sys.stderr)
    if not folders:
        where = f"--models {args.models} holds no bundle" if args.models else "none was given"
        sys.exit(f"error: no bundle to serve ({where}); give BUNDLE folders or --models DIR")
    names = [Path(f).resolve().name for f, _ in folders]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        sys.exit(f"error: two bundles are named {twice[0]!r}; the API names a model by its folder")
    if args.model_name and len(folders) > 1:
        sys.exit("error: --model-name names one bundle; with several, each is named by its folder")
    return folders


def settings_of(args: argparse.Namespace, **given) -> Settings:
    """The Settings of the flags: each field its flag's value (the same name), then `given`."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    flags = {name: value for name, value in vars(args).items() if name in fields}
    return Settings(**flags | given)


def main(argv: list[str] | None = None) -> None:
    # Bundles may come between flags (`doel-serve A --threads 2 B`), as a shell user writes them.
    args = build_parser().parse_intermixed_args(argv)
    check_numbers(args)
    try:
        import uvicorn

        from doel.serve.core.engine import BundleError, read_bundle
        from doel.serve.core.verify import Verification
        from doel.serve.edge.app import create_app
        from doel.serve.edge.connection import protocol_class
        from doel.serve.edge.limits import QuietFloods, Refusals, raise_open_files
    except ModuleNotFoundError as e:
        sys.exit(f"doel-serve needs the {e.name!r} package, part of the serve extra: {EXTRA_HINT}")
    bundles = bundle_folders(args, read_bundle, BundleError)
    folders = [f for f, _ in bundles]
    key = api_key(args)
    keys = key_file(args.api_key_file) if args.api_key_file else None
    check_port(args.host, args.port)
    print(this_class().line(), file=sys.stderr)  # the row of docs/kernels.md this CPU reads
    if key is None and keys is None and not is_loopback(args.host):
        print(
            f"warning: serving on {args.host} without an API key: anyone who can reach it can "
            f"use the model and read /metrics; set {KEY_ENV} or --api-key-file",
            file=sys.stderr,
        )
    settings = settings_of(
        args,
        bundle=folders[0],
        bundles=tuple(folders[1:]),
        checksums=not args.no_checksums,
        api_key=key,
        api_keys=keys,
        cors_origins=tuple(args.cors_origin),
        allowed_hosts=allowed_hosts(args.host, args.allowed_host),
        url=base_url(args.host, args.port),
        # Started now: the files are hashed while the port opens and the model loads.
        verify=None if args.no_checksums else Verification(bundles[0][1]),
        exit_on_damage=True,
    )
    _, files = raise_open_files()
    if files and args.max_connections > files - FD_RESERVE:
        print(
            f"warning: the open-file limit is {files}; --max-connections lowered from "
            f"{args.max_connections} to {files - FD_RESERVE} (raise it with ulimit -n)",
            file=sys.stderr,
        )
        args.max_connections = max(files - FD_RESERVE, 1)
    app = create_app(settings)
    refusals = Refusals(app.state.metrics)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=log_config(args.log_level, QuietFloods(refusals)),
        http=protocol_class(args.timeout_read, args.max_connections, refusals),
        timeout_keep_alive=args.timeout_keep_alive,
    )
