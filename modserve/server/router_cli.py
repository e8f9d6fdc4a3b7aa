"""``modserve router``: the disaggregated-serving router (modserve.server.router) under uvicorn."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def upstream_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s)://HOST:PORT URL")
    if parts.path.rstrip("/") or parts.query:
        raise argparse.ArgumentTypeError(f"{value!r}: give the server's root (http://HOST:PORT), not a path; "
                                         "the router adds /v1/...")
    return f"{parts.scheme}://{parts.netloc}"


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="route OpenAI requests to a prefill server and a decode server (disaggregated serving)",
        description="An OpenAI-compatible router for disaggregated serving: each completion goes first to the "
                    "prefill server (KV producer) with max_tokens=1, then to the decode server (KV consumer), "
                    "whose answer is returned (docs/disaggregation.md).")
    p.add_argument("--prefill", required=True, type=upstream_url, metavar="URL",
                   help="the prefill server, e.g. http://localhost:8100")
    p.add_argument("--decode", required=True, type=upstream_url, metavar="URL",
                   help="the decode server, e.g. http://localhost:8200")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"(default: {DEFAULT_PORT})")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds an upstream server may stay silent before the request fails with 504 "
                        "(default: 3600; 0: no limit)")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from modserve.server.router import create_router_app

    app = create_router_app(args.prefill, args.decode, args.timeout or None)
    print(f"\nmodserve router at http://{args.host}:{args.port}/v1: prefill {args.prefill}, decode {args.decode}\n",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0
