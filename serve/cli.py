"""`doel-serve BUNDLE` (or `python -m serve`): the HTTP server on an export bundle.

It binds 127.0.0.1 unless told otherwise; `--api-key` (or DOEL_API_KEY) then guards every route
but /health. The bundle is checked before the port opens, so a wrong folder is a one-line error.
Heavy imports happen inside `main`, so a missing extra prints the `pip install` line that fixes
it.
"""

from __future__ import annotations

import argparse
import os
import sys

EXTRA_HINT = "pip install 'doel[serve]'"
KEY_ENV = "DOEL_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="doel-serve",
        description="OpenAI-compatible completions over an export bundle, on CPU, without torch",
    )
    p.add_argument("bundle", help="a folder written by doel-export")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: per core)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on all but /health (default: ${KEY_ENV})",
    )
    p.add_argument("--model-name", help="the model's id in the API (default: the folder's name)")
    p.add_argument(
        "--slots", type=int, default=4, help="requests decoded together (each holds a KV cache)"
    )
    p.add_argument("--max-queue", type=int, default=16, help="waiting requests before 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--cors-origin", action="append", default=[], help="allow this browser origin (repeat)"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name in ("threads", "max_queue", "max_body_bytes"):
        if getattr(args, name) < 0:
            sys.exit(f"error: --{name.replace('_', '-')} must be 0 or more")
    if args.slots < 1:
        sys.exit("error: --slots must be 1 or more")
    try:
        import uvicorn

        from serve.app import Settings, create_app
        from serve.engine import BundleError, read_bundle
    except ModuleNotFoundError as e:
        sys.exit(f"doel-serve needs the {e.name!r} package, part of the serve extra: {EXTRA_HINT}")
    try:
        read_bundle(args.bundle)
    except BundleError as e:
        sys.exit(f"error: {e}")
    settings = Settings(
        bundle=args.bundle,
        model_name=args.model_name,
        threads=args.threads,
        api_key=args.api_key or None,
        max_queue=args.max_queue,
        slots=args.slots,
        max_body_bytes=args.max_body_bytes,
        cors_origins=tuple(args.cors_origin),
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
