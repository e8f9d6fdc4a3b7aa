"""Which implementations the kit checks: ``KIND:NAME`` targets resolved against the registry.

Kept apart from the pytest hooks (:mod:`.plugin`) so that resolving names, and the usage
errors it raises, read in one place. Nothing here imports torch: the plugin module is
loaded by every pytest run of a process where modserve is installed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from modserve.core.registry import Registration, Registry

# kind -> the kit module that checks it; the kinds a target may name.
KIT_MODULES: dict[str, str] = {
    "attention_backend": "test_attention_backend",
    "kv_allocator": "test_kv_allocator",
    "scheduler": "test_scheduler",
    "sampler": "test_sampler",
    "grammar_backend": "test_grammar_backend",
    "quantizer": "test_quantizer",
    "proposer": "test_proposer",
    "executor": "test_executor",
    "kv_connector": "test_kv_connector",
    "tool_parser": "test_tool_parser",
    "reasoning_parser": "test_reasoning_parser",
    "lora_resolver": "test_lora_resolver",
    "logits_processor": "test_logits_processor",
}


def _draft_checkpoint() -> dict[str, Any]:
    from modserve.testing import cached_checkpoint

    return {"model": str(cached_checkpoint("llama", "tiny"))}


def _kit_adapters() -> Any:
    from modserve.testing.conformance.adapter_dirs import kit_adapters

    return kit_adapters()


def _storage_dir() -> dict[str, Any]:
    import tempfile

    return {"path": tempfile.mkdtemp(prefix="modserve-kit-kv-"), "delete_on_close": True}


# Options the kit passes to built-ins that cannot run on their defaults, or run slowly on them,
# when the command line gives none. NOTE: keyed on the distribution too: a third-party name never
# picks these up.
BUILTIN_OPTIONS: dict[tuple[str, str], Callable[[], dict[str, Any]]] = {
    ("proposer", "draft_model"): _draft_checkpoint,
    ("kv_connector", "shared_storage"): _storage_dir,  # not the default ./kv_store of the directory it runs in
    ("kv_connector", "host"): lambda: {"num_blocks": 64},  # not 4 GiB
    ("kv_connector", "mooncake"): lambda: {"num_blocks": 64, "bootstrap_port": 0},  # not 1 GiB, nor port 8998
    ("lora_resolver", "filesystem"): lambda: {"cache_dir": str(_kit_adapters())},  # not $VLLM_LORA_RESOLVER_CACHE_DIR
    # A worker that does not stop is killed after stop_timeout: 2 s, not the default 10, of waiting.
    ("executor", "mp"): lambda: {"stop_timeout": 2},
    ("executor", "ray"): lambda: {"stop_timeout": 2},
}


@dataclass(frozen=True)
class Implementation:
    """One registered implementation under test, with the options it is built with."""

    kind: str
    name: str
    registration: Registration = field(compare=False, repr=False)
    options: dict[str, Any] | None = field(default=None, compare=False)  # None: defaults
    registry: Registry | None = field(default=None, compare=False, repr=False)  # where it was found


    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    def load(self) -> type:
        """The implementation's class (importing its module)."""
        return self.registration.load()

    def option_values(self) -> dict[str, Any]:
        if self.options is not None:
            return dict(self.options)
        builtin = BUILTIN_OPTIONS.get((self.kind, self.name))
        if builtin is not None and self.registration.distribution == "modserve":
            return builtin()
        return {}

    def validated_options(self) -> Any:
        """The options validated as the core validates them. Options that do not validate (a
        required one missing) skip the test, saying how to pass them."""
        try:
            return self.registration.validate_options(self.option_values())
        except ValueError as e:
            pytest.skip(f"{self} cannot be built without options ({e}); pass them with "
                        f"--modserve-conformance-options '{self}={{...}}' (JSON)")

    def create(self, *args: Any, **kwargs: Any) -> Any:
        """``cls(*args, options=<validated options>, **kwargs)``, as the core builds it."""
        options = self.validated_options()
        return self.load()(*args, options=options, **kwargs)


def parse_target(text: str, flag: str = "--modserve-conformance") -> tuple[str, str]:
    kind, sep, name = text.partition(":")
    if not sep or not kind or not name:
        raise pytest.UsageError(f"{flag} takes KIND:NAME (e.g. attention_backend:paged), got {text!r}")
    return kind, name


def parse_options(entries: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """``KIND:NAME=JSON`` entries -> options per target."""
    flag = "--modserve-conformance-options"
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in entries:
        target, sep, raw = entry.partition("=")
        if not sep:
            raise pytest.UsageError(f"{flag} takes KIND:NAME=JSON, got {entry!r}")
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise pytest.UsageError(f"{flag} {target}: the options are not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise pytest.UsageError(f"{flag} {target}: the options must be a JSON object, got {raw!r}")
        found[parse_target(target, flag)] = value
    return found


@dataclass
class Selection:
    """What a run checks: the targets named on the command line, else everything registered."""

    named: dict[str, list[str]] | None  # kind -> names; None: every registered implementation
    options: dict[tuple[str, str], dict[str, Any]]
    _registry: Registry | None = None

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            from modserve.core.registry import get_registry  # honours MODSERVE_LOAD_PLUGINS

            self._registry = get_registry()
        return self._registry

    def check(self) -> None:
        """Usage errors for an unknown kind or name, and for options of a target not checked."""
        for kind, name in [*((k, n) for k, names in (self.named or {}).items() for n in names), *self.options]:
            if kind not in KIT_MODULES:
                raise pytest.UsageError(f"the conformance kit has no tests for kind {kind!r}; "
                                        f"kinds it checks: {', '.join(KIT_MODULES)}")
            try:
                self.registry.get(kind, name)
            except ValueError as e:  # "unknown sampler 'x'; available: ..." from the registry
                raise pytest.UsageError(f"{kind}:{name}: {e}") from None
        for kind, name in self.options:
            if self.named is not None and name not in self.named.get(kind, []):
                raise pytest.UsageError(f"--modserve-conformance-options names {kind}:{name}, "
                                        f"which no --modserve-conformance selects")

    def implementations(self, kind: str) -> list[Implementation] | None:
        """The implementations of ``kind`` to check; None when the targets leave the kind out."""
        if self.named is not None and kind not in self.named:
            return None
        names = self.named[kind] if self.named is not None else self.registry.names(kind)
        return [Implementation(kind, n, self.registry.get(kind, n), self.options.get((kind, n)), self.registry)
                for n in names]


def selection(targets: list[str], options: list[str]) -> Selection:
    named: dict[str, list[str]] | None = None
    if targets:
        named = {}
        for text in targets:
            kind, name = parse_target(text)
            if name not in named.setdefault(kind, []):
                named[kind].append(name)
    return Selection(named, parse_options(options))
