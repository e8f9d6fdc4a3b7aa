"""The ``modserve`` command: serve, generate, bench, compare, plan, plugins, conformance."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from modserve.core.config import EngineConfig
    from modserve.core.registry import Registration, Registry

logger = logging.getLogger("modserve")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# One spelling per concept across commands; these others are kept as aliases.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"num_threads": ("--threads",), "tensor_parallel_size": ("-tp",)}
# Taken as typed, never read as YAML (`--served-model-name on` is a name, not a boolean).
TEXT_FIELDS = ("model", "tokenizer", "served_model_name", "device", "chat_template", "generation_config")
LIST_FIELDS = ("cuda_graph_sizes",  # vLLM's `--cuda-graph-sizes 1 2 4` (or one YAML list; none: [])
               "lora_modules",  # vLLM's `--lora-modules a=/path '{"name": "b", "path": "/p"}'`
               "logits_processors",  # vLLM's `--logits-processors pkg.mod:Class no_repeat_ngram`
               "lora_resolvers")  # `--lora-resolvers filesystem '{name: s3, options: {...}}'`


class Parser(argparse.ArgumentParser):
    """Every modserve parser and subparser: no abbreviations (``--max-num-seq`` is an error,
    not ``--max-num-seqs``), and ``--log-level`` before or after the subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                          help="logging level (default: INFO)")


def add_config_flags(parser: argparse.ArgumentParser, config_file: bool = True, positional_model: bool = False,
                     title: str = "engine config (override the file)") -> None:
    """``--config FILE`` plus one flag per EngineConfig field (``--max-model-len 512``), and
    vLLM's spellings of the same settings (``--enable-prefix-caching``, ``-tp 1``).

    Values of modserve's flags are parsed as YAML scalars/mappings, so ``--attention-backend
    reference`` and ``--scheduler '{name: fcfs, options: {}}'`` both work.
    """
    from modserve.core.config import EngineConfig
    from modserve.vllm_compat import VLLM_OPTIONS

    if positional_model:
        parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                            help="checkpoint directory, as in `vllm serve MODEL` (the same as --model)")
    if config_file:
        parser.add_argument("--config", help="YAML or TOML engine config file (a `vllm serve` YAML file works)")
    group = parser.add_argument_group(title)
    fields = EngineConfig.model_fields
    # A vLLM option spelled as a field is that field's flag (vLLM's short flag too: -pp, -dp);
    # its entry applies only while modserve has no such field (vllm_compat.translate).
    shorts = {o.key: (o.short,) for o in VLLM_OPTIONS if o.short and o.key in fields}
    for name, field in fields.items():
        metavar, help_text = field_help(name, field)
        extra: dict[str, Any] = {"nargs": "+"} if name == "served_model_name" else {"nargs": "*"} \
            if name in LIST_FIELDS else {"action": argparse.BooleanOptionalAction} if field.annotation is bool else {}
        if field.annotation is not bool:  # a bare flag and its --no- form, as vLLM's booleans
            extra["metavar"] = metavar
        group.add_argument("--" + name.replace("_", "-"), *FLAG_ALIASES.get(name, ()), *shorts.get(name, ()),
                           dest=f"cfg_{name}", help=help_text, **extra)
    vllm = parser.add_argument_group("vLLM's spellings", "mapped onto the settings above, refused with the "
                                     "reason, or ignored with a warning (docs/configuration.md)")
    for option in VLLM_OPTIONS:
        if option.key in fields:
            continue
        kwargs = dict(option.arg)
        if kwargs.get("action") == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
        flags = ["--" + option.key.replace("_", "-"), *([option.short] if option.short else [])]
        what = {"mapped": "= ", "refused": _refused_unless(option.default), "ignored": "ignored: "}[option.kind]
        vllm.add_argument(*flags, dest=f"vllm_{option.key}", default=None,
                          help=(what + option.maps_to).replace("%", "%%"), **kwargs)


def _refused_unless(default: Any) -> str:
    if default is None or isinstance(default, bool):
        return "refused: "
    values = default if isinstance(default, tuple) else (default,)
    return f"refused unless {' or '.join(map(str, values))}: "


def field_help(name: str, field: FieldInfo) -> tuple[str, str]:
    """(metavar, help) of an EngineConfig field's flag: its type or choices, and its default."""
    import typing

    from pydantic_core import PydanticUndefined

    from modserve.core.config import PluginChoice, SpeculativeConfig

    args = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
    if typing.get_origin(args[0]) is list and name in LIST_FIELDS:  # one flag value per item
        args = list(typing.get_args(args[0]))
    if typing.get_origin(field.annotation) is typing.Literal:
        choices = list(typing.get_args(field.annotation))
        metavar = "{" + ",".join(choices) + "}"
    elif PluginChoice in args:
        metavar = "NAME|MAPPING"
    elif SpeculativeConfig in args:
        metavar = "MAPPING"
    elif typing.get_origin(args[0]) is dict:  # vLLM's JSON flags (--override-generation-config)
        metavar = "JSON"
    else:
        metavar = {int: "INT", float: "FLOAT", bool: "BOOL"}.get(args[0], "PATH" if name in ("model", "tokenizer")
                                                                  else "TEXT")
    default = field.default
    if default is PydanticUndefined:
        shown = "required"
    elif default is None:
        shown = "unset"
    elif isinstance(default, PluginChoice):
        shown = default.name
    else:
        shown = str(default).lower() if isinstance(default, bool) else str(default)
    note = "; booleans work too" if metavar == "{auto,on,off}" else ""
    text = field.description or ""
    if not (default is None and "default" in text.lower()):  # it says the default in words
        text += f" (default: {shown}{note})"
    return metavar, text.replace("%", "%%")


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the command line gave: modserve's keys (values read as YAML) and
    vLLM's (typed by argparse), for :func:`modserve.vllm_compat.engine_config`."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if value is None:
            continue
        if key.startswith("cfg_"):
            name = key[4:]
            if name in LIST_FIELDS:
                items = [_yaml_value(name, v) for v in value]
                out[name] = items[0] if len(items) == 1 and isinstance(items[0], list) else items
            else:
                out[name] = value if name in TEXT_FIELDS or isinstance(value, bool) else _yaml_value(name, value)
        elif key.startswith("vllm_"):
            out[key[5:]] = value
    model = getattr(args, "model_tag", None)
    if model is not None:
        if out.get("model", model) != model:
            raise ValueError(f"two models given: MODEL {model} and --model {out['model']}")
        out["model"] = model
    return out


def _yaml_value(name: str, text: str) -> Any:
    from modserve.config_files import yaml_error

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--{name.replace('_', '-')} {text!r}: {yaml_error(e)}") from None


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of ``--config`` and the engine flags (flags win), logged as selected.
    A file's server keys (``port: 8001`` in a vLLM config) fill the command's flags of that name."""
    from modserve.config_files import load_config_file
    from modserve.vllm_compat import SERVER_KEYS, engine_config

    data = load_config_file(args.config) if getattr(args, "config", None) else {}
    for key in SERVER_KEYS:
        if key not in data:
            continue
        value = data.pop(key)
        dest = key if hasattr(args, key) else f"vllm_{key}"  # vLLM's flags (disable_uvicorn_access_log)
        if not hasattr(args, dest):
            logger.warning("config key %s is a setting of `modserve serve`; ignored here", key)
        elif getattr(args, dest) is None:
            setattr(args, dest, value)
    config = engine_config(data, **engine_overrides(args))
    log_selection(config)
    return config


def log_selection(config: EngineConfig, label: str = "") -> None:
    """One line: the implementation selected for each kind, third-party ones with their distribution."""
    from modserve.core.registry import BUILTIN_DISTRIBUTION, get_registry

    checkpoint = _checkpoint_config(config.model)
    quantizer = config.quantization.name if config.quantization else \
        (checkpoint.get("quantization_config") or {}).get("quant_method")
    architecture = (checkpoint.get("architectures") or [None])[0]
    chosen = {"platform": config.platform_choice().name, "model_architecture": architecture,
              "attention_backend": config.attention_backend.name, "kv_allocator": config.kv_allocator.name,
              "scheduler": config.scheduler.name, "sampler": config.sampler.name, "quantizer": quantizer,
              "grammar_backend": config.grammar_backend.name,
              "proposer": config.speculative.proposer.name if config.speculative else None}
    registry = get_registry()
    parts = []
    for kind, name in chosen.items():
        if name is None:
            parts.append(f"{kind}=none")
            continue
        try:
            reg = registry.get(kind, name)
        except ValueError:  # grammar_backend auto, or an unknown name (the engine's check says so)
            parts.append(f"{kind}={name}")
            continue
        dist = "" if reg.distribution == BUILTIN_DISTRIBUTION else f" ({reg.distribution} {reg.version})"
        parts.append(f"{kind}={name}{dist}")
    logger.info("%sselected: %s", f"{label}: " if label else "", ", ".join(parts))


def _checkpoint_config(model_dir: str) -> dict[str, Any]:
    from pathlib import Path

    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


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
    from modserve.server.demo import use_demo_model

    if not args.config and args.cfg_model is None and args.model_tag is None:
        use_demo_model(args)  # as `modserve serve` does
    config = config_from_args(args)
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.sample_seed)
    outputs = llm.generate(args.prompt, params)
    if len(outputs) == 1:
        print(outputs[0].outputs[0].text)
        return 0
    for prompt, out in zip(args.prompt, outputs):  # labelled, as vLLM's examples print them
        print(f"Prompt: {prompt!r}, Generated text: {out.outputs[0].text!r}")
    return 0


# The kinds the conformance kit checks (modserve.testing.conformance).
CONFORMANCE_KINDS: tuple[str, ...] = (
    "attention_backend", "kv_allocator", "scheduler", "sampler", "grammar_backend", "quantizer", "proposer",
    "executor", "kv_connector", "tool_parser", "reasoning_parser", "lora_resolver",
    "logits_processor")

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
SUBCOMMAND_MODULES: tuple[str, ...] = ("modserve.server.cli", "modserve.bench.cli", "modserve.bench.eval_cli",
                                       "modserve.server.router_cli", "modserve.quantizers.calibration.cli")


def build_parser() -> argparse.ArgumentParser:
    from modserve import __version__

    parser = Parser(prog="modserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"modserve {__version__}")
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

    p = sub.add_parser("generate", help="generate text offline for one or more prompts",
                       description="Generate text offline. With neither --config nor a model, runs the "
                                   "built-in demo model (a 5M-parameter Llama trained on the King James Bible).")
    add_config_flags(p, positional_model=True)
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
    args.log_level = getattr(args, "log_level", "INFO")
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `modserve plan ... | head`: the reader left; no traceback, as other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


if __name__ == "__main__":
    sys.exit(main())
