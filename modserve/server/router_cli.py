"""``modserve router``: the disaggregated-serving router (modserve.server.router) under uvicorn."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

from modserve.server.router_timeouts import Timeouts

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
PREFIX_BALANCE_SLACK = 4


def upstream_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s)://HOST:PORT URL")
    if parts.path.rstrip("/") or parts.query:
        raise argparse.ArgumentTypeError(f"{value!r}: give the server's root (http://HOST:PORT), not a path; "
                                         "the router adds /v1/...")
    return f"{parts.scheme}://{parts.netloc}"


def kv_events_source(value: str) -> tuple[str, str, str | None]:
    """``URL=ENDPOINT[,REPLAY_ENDPOINT]``: a prefill server and where it publishes its KV events."""
    url, eq, endpoints = value.partition("=")
    endpoint, _, replay = endpoints.partition(",")
    if not eq or not endpoint:
        raise argparse.ArgumentTypeError(f"{value!r}: give URL=ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                                         "http://a:8100=tcp://a:5557,tcp://a:5558")
    for e in filter(None, (endpoint, replay)):
        if not e.startswith(("tcp://", "ipc://")) or "*" in e:
            raise argparse.ArgumentTypeError(f"{value!r}: {e!r} is not a tcp://HOST:PORT or ipc:// address to "
                                             "connect to (the server's kv_events_config binds tcp://*:PORT; "
                                             "name its host here)")
    return upstream_url(url), endpoint, replay or None


def at_least_one(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a whole number of requests, 1 or more")
    return n


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
                        "fewest requests outstanding through the router, among those whose /health answers (with "
                        "--prefill-kv-events: the one holding the longest cached prefix)")
    p.add_argument("--decode", required=True, type=upstream_url, metavar="URL", action="extend", nargs="+",
                   help="a decode server, e.g. http://localhost:8200; several: the one with the fewest requests "
                        "outstanding, among those whose /health answers")
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
                   help="seconds a server's /health answer is trusted before a request asks again "
                        f"(default: {d.health_ttl:g}; 0: every request)")
    p.add_argument("--prefill-kv-events", type=kv_events_source, action="append", default=[],
                   metavar="URL=ENDPOINT[,REPLAY_ENDPOINT]",
                   help="follow a prefill server's KV cache events (its --kv-events-config endpoint and "
                        "replay_endpoint, as this router reaches them, e.g. http://a:8100=tcp://a:5557,tcp://a:5558) "
                        "and send each request to the prefill server holding the longest cached prefix of its "
                        "prompt; once per prefill server (or per data-parallel rank of one); needs --tokenizer")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the model's directory (or its tokenizer's), as the servers' --model/--tokenizer: the router "
                        "tokenizes prompts as they do, to hash their blocks (--prefill-kv-events only)")
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help="the servers' --chat-template (Jinja text or a file), if they were given one")
    p.add_argument("--prefix-balance-slack", type=at_least_one, default=PREFIX_BALANCE_SLACK, metavar="N",
                   help="a prefill server that holds more of a prompt wins only while it has fewer than N more "
                        f"requests outstanding than the least loaded one (default: {PREFIX_BALANCE_SLACK})")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from modserve.server.router import create_router_app

    timeouts = Timeouts(connect=args.connect_timeout, read=args.read_timeout or None, health=args.health_timeout,
                        health_ttl=max(0.0, args.health_ttl))
    prefix = None
    if args.prefill_kv_events:
        from modserve.core.config import chat_template_text
        from modserve.server.router_prefix import PrefixRouting

        if not args.tokenizer:
            raise SystemExit("modserve router: --prefill-kv-events needs --tokenizer (the model's directory): the "
                             "router hashes each prompt's tokens as the servers do")
        try:
            template = chat_template_text(args.chat_template) if args.chat_template else None
        except ValueError as e:
            raise SystemExit(f"modserve router: --chat-template: {e}") from None
        prefix = PrefixRouting(tuple(args.prefill_kv_events), args.tokenizer, template, args.prefix_balance_slack)
    try:
        app = create_router_app(args.prefill, args.decode, timeouts, prefix)
    except ValueError as e:
        raise SystemExit(f"modserve router: {e}") from None
    print(f"\nmodserve router at http://{args.host}:{args.port}/v1: prefill {' '.join(args.prefill)}, "
          f"decode {' '.join(args.decode)}\n", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0
