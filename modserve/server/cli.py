"""``modserve serve``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

logger = logging.getLogger("modserve.server")


def add_parsers(subparsers: Any) -> None:
    from modserve.cli import add_config_flags

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API. With neither --config nor "
                    "--model, serves the built-in demo model (random weights: its text is random).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MODSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MODSERVE_API_KEY)")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from modserve.cli import config_from_args
    from modserve.core.engine import LLMEngine
    from modserve.server.app import create_app
    from modserve.server.run import run

    if not args.config and args.cfg_model is None:
        use_demo_model(args)
    config = config_from_args(args)
    engine = LLMEngine(config, progress=False)
    run(create_app(engine, api_key=args.api_key), args.host, args.port, args.log_level, args.api_key, config)
    return 0


def use_demo_model(args: argparse.Namespace) -> None:
    from modserve.server.demo import DEMO_DEFAULTS, KV_SIZE_FIELDS, demo_model_dir

    logger.info("no --config or --model: serving the demo model (random weights, random text)")
    args.cfg_model = str(demo_model_dir())
    sized = any(getattr(args, f"cfg_{name}") is not None for name in KV_SIZE_FIELDS)
    for name, value in DEMO_DEFAULTS.items():
        if getattr(args, f"cfg_{name}") is None and not (sized and name in KV_SIZE_FIELDS):
            setattr(args, f"cfg_{name}", value)
