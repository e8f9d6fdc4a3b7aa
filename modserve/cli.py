"""The ``modserve`` command: plugins, generate (and serve, bench, compare as they land)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

import yaml


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` plus one flag per EngineConfig field (``--max-model-len 512``).

    Values are parsed as YAML scalars/mappings, so ``--attention-backend reference``
    and ``--scheduler '{name: fcfs, options: {}}'`` both work.
    """
    from modserve.core.config import EngineConfig

    parser.add_argument("--config", help="YAML or TOML engine config file")
    group = parser.add_argument_group("engine config (override the file)")
    for name, field in EngineConfig.model_fields.items():
        group.add_argument("--" + name.replace("_", "-"), dest=f"cfg_{name}", metavar="VALUE",
                           help=field.description or None)


def config_from_args(args: argparse.Namespace) -> Any:
    from modserve.core.config import EngineConfig, load_config_file

    data = load_config_file(args.config) if args.config else {}
    overrides = {
        key[4:]: yaml.safe_load(value)
        for key, value in vars(args).items()
        if key.startswith("cfg_") and value is not None
    }
    if "model" in overrides:
        overrides["model"] = str(overrides["model"])
    return EngineConfig.from_dict(data, **overrides)


def cmd_plugins(args: argparse.Namespace) -> int:
    from modserve.core.registry import get_registry

    registry = get_registry()
    info = registry.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for dist in info:
        print(f"{dist['distribution']} {dist['version']}")
        for kind, names in sorted(dist["registered"].items()):
            print(f"  {kind}: {', '.join(sorted(names))}")
        for err in dist.get("errors", []):
            print(f"  failed to import: {err}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from modserve import LLM, SamplingParams

    config = config_from_args(args)
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.sample_seed)
    for out in llm.generate(args.prompt, params):
        print(out.outputs[0].text)
    return 0


# Modules that add their own subcommands: each defines add_parsers(subparsers) and
# imports anything heavy inside its command functions, so `modserve --help` stays fast.
SUBCOMMAND_MODULES: tuple[str, ...] = ("modserve.server.cli", "modserve.bench.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed plugins and what each registered")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("generate", help="generate text offline for one or more prompts")
    add_config_flags(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.set_defaults(func=cmd_generate)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
