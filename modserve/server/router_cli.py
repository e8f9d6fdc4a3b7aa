"""``modserve router``: the disaggregated-serving router (modserve.server.router) under uvicorn."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

from modserve.server.router_timeouts import Timeouts

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def upstream_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s)://HOST:PORT URL")
    if parts.path.rstrip("/") or parts.query:
        raise argparse.ArgumentTypeError(f"{value!r}: give the server's root (http://HOST:PORT), not a path; "
                                         "the router adds /v1/...")
    return f"{parts.scheme}://{parts.netloc}"


def positive(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of seconds above 0")
    return seconds


def add_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="route OpenAI requests to a prefill server and a decode server (disaggregated serving)",
        description="An OpenAI-compatible router for disaggregated serving: each completion goes first to the "
                    "prefill server (KV producer) with max_tokens=1, then to the decode server (KV consumer), "
                    "whose answer is returned (docs/disaggregation.md).")
    # Repeatable (--prefill A --prefill B) or, as vLLM's disaggregation proxy takes them, several after one flag.
    p.add_argument("--prefill", required=True, type=upstream_url, metavar="URL", action="extend", nargs="+",
                   help="a prefill server, e.g. http://localhost:8100; several: each request goes to the one with the "
                        "fewest requests outstanding through the router")
    p.add_argument("--decode", required=True, type=upstream_url, metavar="URL", action="extend", nargs="+",
                   help="a decode server, e.g. http://localhost:8200; several: as --prefill, among those whose "
                        "/health answers")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"(default: {DEFAULT_PORT})")
    d = Timeouts()
    p.add_argument("--connect-timeout", type=positive, default=d.connect, metavar="S",
                   help=f"seconds an upstream may take to accept a connection; past it 504 (default: {d.connect:g})")
    p.add_argument("--read-timeout", "--timeout", type=float, default=d.read, metavar="S",
                   help="seconds an upstream may stay silent (a whole non-streamed answer, or between two stream "
                        f"events) before the request fails with 504 or an error event (default: {d.read:g}; 0: no "
                        "limit)")
    p.add_argument("--health-timeout", type=positive, default=d.health, metavar="S",
                   help=f"seconds each upstream's /health (and /metrics) may take (default: {d.health:g})")
    p.add_argument("--health-ttl", type=float, default=d.health_ttl, metavar="S",
                   help="seconds the decode server's /health answer is trusted before a request asks again "
                        f"(default: {d.health_ttl:g}; 0: every request)")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from modserve.server.router import create_router_app

    timeouts = Timeouts(connect=args.connect_timeout, read=args.read_timeout or None, health=args.health_timeout,
                        health_ttl=max(0.0, args.health_ttl))
    try:
        app = create_router_app(args.prefill, args.decode, timeouts)
    except ValueError as e:
        raise SystemExit(f"modserve router: {e}") from None
    print(f"\nmodserve router at http://{args.host}:{args.port}/v1: prefill {' '.join(args.prefill)}, "
          f"decode {' '.join(args.decode)}\n", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0
