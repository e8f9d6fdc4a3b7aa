"""The ``modserve`` command: plugins, conformance, generate (and serve, bench, compare as they land)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from modserve.core.registry import Registration, Registry


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

    info = plugin_listing(get_registry())
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print("\n".join(format_listing(info)))
    return 0


def plugin_listing(registry: Registry) -> list[dict[str, Any]]:
    """``Registry.describe()`` plus, per distribution, each implementation's description and
    options, and the load failures under ``errors``.

    NOTE: resolving an options model imports its module (often the implementation's own);
    only this listing does that for every plugin, never an engine start. An options target
    that fails to import is that implementation's ``error``, not a failure of the listing.
    """
    info = registry.describe()
    by_kind = registry.registrations()
    for dist in info:
        dist.setdefault("errors", [])
        dist["registrations"] = [describe_registration(reg) for regs in by_kind.values()
                                 for _, reg in sorted(regs.items()) if reg.distribution == dist["distribution"]]
    return info


def describe_registration(reg: Registration) -> dict[str, Any]:
    """One implementation: kind, name, description, options (one entry per field), error."""
    from pydantic import BaseModel

    entry: dict[str, Any] = {"kind": reg.kind, "name": reg.name, "description": reg.description,
                             "options": [], "error": None}
    try:
        model = reg.options_model()
        if model is None:
            return entry
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"options of {reg.kind} {reg.name!r} from {reg.origin} is {model!r}, "
                            "not a pydantic model class")
        entry["options"] = [describe_option(name, field) for name, field in model.model_fields.items()]
    except Exception as e:  # the plugin's fault: shown beside it, the rest still listed
        entry["error"] = str(e) or type(e).__name__
    return entry


def describe_option(name: str, field: FieldInfo) -> dict[str, Any]:
    """A pydantic ``FieldInfo`` as plain data: the config key, type, default and constraints."""
    from pydantic_core import to_jsonable_python

    required = field.is_required()
    default = None if required else field.get_default(call_default_factory=True)
    return {
        "name": field.alias or name,
        "type": _type_name(field.annotation),
        "default": to_jsonable_python(default, fallback=repr),
        "required": required,
        "description": field.description or "",
        "constraints": [_constraint(m) for m in field.metadata],  # ["ge=0"], from Field(ge=0)
    }


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type) and not getattr(annotation, "__args__", None):
        return annotation.__name__  # int, not <class 'int'>
    return str(annotation).replace("typing.", "")  # Literal['a', 'b'], int | None


def _constraint(meta: Any) -> str:
    import dataclasses

    if dataclasses.is_dataclass(meta):  # annotated_types: Ge(ge=0) -> "ge=0"
        return ", ".join(f"{f.name}={getattr(meta, f.name)!r}" for f in dataclasses.fields(meta))
    if getattr(meta, "__dict__", None):  # pydantic's own metadata: pattern=, strict=, ...
        return ", ".join(f"{k}={v!r}" for k, v in vars(meta).items())
    return repr(meta)


def format_listing(info: list[dict[str, Any]], width: int = 100) -> list[str]:
    """The text form of :func:`plugin_listing`: per distribution, per kind, each
    implementation with its description and options."""
    import textwrap

    def wrap(text: str, indent: str, more: str = "    ") -> list[str]:
        return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent + more,
                             break_on_hyphens=False) or [indent]

    lines: list[str] = []
    for dist in info:
        lines.append(f"{dist['distribution']} {dist['version']}")
        kinds: dict[str, list[dict[str, Any]]] = {}
        for reg in dist["registrations"]:
            kinds.setdefault(reg["kind"], []).append(reg)
        for kind, regs in kinds.items():
            lines.append(f"  {kind}")
            for reg in regs:
                lines += wrap(f"{reg['name']}" + (f" — {reg['description']}" if reg["description"] else ""), " " * 4)
                if reg["error"]:
                    lines += wrap(f"options failed to load: {reg['error']}", " " * 6)
                elif not reg["options"]:
                    lines.append(" " * 6 + "options: none")
                else:
                    lines.append(" " * 6 + "options:")
                    for opt in reg["options"]:
                        kind_of = ", ".join([opt["type"], *opt["constraints"]])
                        value = "required" if opt["required"] else "= " + json.dumps(opt["default"])
                        lines += wrap(f"{opt['name']} ({kind_of}) {value}", " " * 8)
                        if opt["description"]:
                            lines += wrap(opt["description"], " " * 12, "")
        for err in dist["errors"]:
            lines += wrap(f"failed to load: {err}", "  ")
    return lines


def cmd_generate(args: argparse.Namespace) -> int:
    from modserve import LLM, SamplingParams

    config = config_from_args(args)
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.sample_seed)
    for out in llm.generate(args.prompt, params):
        print(out.outputs[0].text)
    return 0


# The kinds the conformance kit checks (modserve.testing.conformance).
CONFORMANCE_KINDS: tuple[str, ...] = (
    "attention_backend", "kv_allocator", "scheduler", "sampler", "grammar_backend", "quantizer", "proposer")

CONFORMANCE_HELP = f"""\
Check plugin implementations against their kind's contract with the conformance kit
(modserve.testing.conformance, a pytest suite), exactly as a plugin's own CI would.

Each target is KIND:NAME, the kind and the registered name, e.g. attention_backend:paged.
Kinds: {", ".join(CONFORMANCE_KINDS)}.
The implementation is found as an engine finds it: installed distributions' entry points,
filtered by MODSERVE_LOAD_PLUGINS.

Arguments after -- go to pytest unchanged:
  modserve conformance scheduler:fcfs sampler:default -- -x -q -k greedy
among them the kit's own, such as options for an implementation that needs them:
  modserve conformance proposer:mydraft -- --modserve-conformance-options 'proposer:mydraft={{"model": "/ckpt"}}'

The exit status is pytest's (0: every check passed)."""


def conformance_target(value: str) -> str:
    kind, sep, name = value.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{value!r} is not KIND:NAME (e.g. attention_backend:paged)")
    if kind not in CONFORMANCE_KINDS:
        raise argparse.ArgumentTypeError(f"unknown kind {kind!r} in {value!r}; kinds: {', '.join(CONFORMANCE_KINDS)}")
    return value


def cmd_conformance(args: argparse.Namespace) -> int:
    try:  # lazily: the kit imports pytest, a test dependency
        from modserve.testing.conformance import run
    except ModuleNotFoundError as e:
        if e.name not in ("pytest", "modserve.testing", "modserve.testing.conformance"):
            raise
        if e.name == "pytest":
            print("error: the conformance kit runs on pytest: pip install 'modserve[test]'", file=sys.stderr)
        else:
            print(f"error: this modserve has no conformance kit ({e.name} is missing)", file=sys.stderr)
        return 2
    return int(run(list(args.targets), list(args.pytest_args)))


def split_pytest_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``modserve conformance T... -- ARGS``: what follows the first ``--`` goes to pytest
    unparsed (argparse would let the targets swallow it). Other commands keep their ``--``."""
    if "--" in argv and "conformance" in argv[: argv.index("--")]:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


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

    p = sub.add_parser("conformance", help="run the plugin conformance kit on KIND:NAME implementations",
                       description=CONFORMANCE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="%(prog)s [-h] KIND:NAME [KIND:NAME ...] [-- PYTEST_ARGS ...]")
    p.add_argument("targets", nargs="+", type=conformance_target, metavar="KIND:NAME",
                   help="an implementation to check, e.g. scheduler:fcfs")
    p.set_defaults(func=cmd_conformance, pytest_args=[])

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
    argv, pytest_args = split_pytest_args(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if pytest_args:
        args.pytest_args = pytest_args
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
