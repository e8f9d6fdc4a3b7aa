"""Finds plugins, records what each registered, and resolves names from config.

Plugins are Python modules (or objects) implementing hooks from
:mod:`modserve.core.hookspecs`. They arrive through entry points of the
``modserve`` group, or are registered directly (tests, embedding applications)
with :meth:`Registry.add_plugin`. ``MODSERVE_LOAD_PLUGINS`` (a comma list of
distribution names) filters the third-party distributions; the built-ins, which
register through the same entry points, always load (an empty value: built-ins only).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import logging
import os
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pluggy
from pydantic import BaseModel, ValidationError

from modserve.core import hookspecs

logger = logging.getLogger("modserve")

GROUP = "modserve"
ENV_ALLOWLIST = "MODSERVE_LOAD_PLUGINS"
BUILTIN_DISTRIBUTION = "modserve"  # the built-ins' distribution: never filtered out


class PluginError(RuntimeError):
    """A plugin could not be loaded, registered something invalid, or failed when used."""


@dataclass(slots=True)
class Registration:
    """One implementation a plugin registered."""

    kind: str
    name: str
    target: str | Callable[[], Any]
    options: type[BaseModel] | str | None
    description: str
    plugin: str  # pluggy plugin name
    distribution: str
    version: str
    # Higher first where the core picks among a kind's implementations itself (the
    # grammar backend ``auto`` tries them by priority for the constraint's kind).
    priority: dict[str, int] = field(default_factory=dict)

    @property
    def origin(self) -> str:
        return f"{self.distribution} {self.version} (plugin {self.plugin!r})"

    def load(self) -> Any:
        """Import the implementation; errors name the plugin and its distribution."""
        try:
            return _import_target(self.target)
        except Exception as e:
            raise PluginError(
                f"{self.kind} {self.name!r} from {self.origin} failed to load: {type(e).__name__}: {e}"
            ) from e

    def create(self, options: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """The implementation made with ``options`` validated (see :meth:`Registry.create`);
        a registration that pickles does this in another process too."""
        validated = self.validate_options(options)
        cls = self.load()
        try:
            made = cls(*args, options=validated, **kwargs)
        except Exception as e:
            raise PluginError(
                f"{self.kind} {self.name!r} from {self.origin} failed to initialise: {type(e).__name__}: {e}"
            ) from e
        mark(made, self)
        return made

    def options_model(self) -> type[BaseModel] | None:
        if self.options is None:
            return None
        try:
            return _import_target(self.options)
        except Exception as e:
            raise PluginError(
                f"options of {self.kind} {self.name!r} from {self.origin} failed to load: {e}"
            ) from e

    def validate_options(self, options: dict[str, Any]) -> BaseModel | None:
        model = self.options_model()
        if model is None:
            if options:
                raise ValueError(
                    f"{self.kind} {self.name!r} takes no options, got {sorted(options)}"
                )
            return None
        try:
            return model.model_validate(options)
        except ValidationError as e:
            from modserve.core.config import describe_validation_error

            raise ValueError(
                f"invalid options for {self.kind} {self.name!r}: {describe_validation_error(e, 'option')}"
            ) from None


@dataclass(slots=True)
class LoadFailure:
    plugin: str
    distribution: str
    version: str
    error: str


@dataclass
class Registry:
    """All implementations known to this process, per kind and name."""

    pm: pluggy.PluginManager = field(default_factory=lambda: pluggy.PluginManager(GROUP))
    import_failures: list[LoadFailure] = field(default_factory=list)
    _hook_failures: list[LoadFailure] = field(default_factory=list)  # found by the last _collect
    _by_kind: dict[str, dict[str, Registration]] | None = None
    _dists: dict[str, tuple[str, str]] = field(default_factory=dict)  # plugin name -> (dist, version)

    def __post_init__(self) -> None:
        self.pm.add_hookspecs(hookspecs)

    # -- finding plugins -------------------------------------------------
    def load_entrypoints(self, allow: set[str] | None = None) -> None:
        """Load the ``modserve`` entry points of installed distributions.

        ``allow`` limits the third-party ones to those distributions (None: all);
        modserve's own built-ins load whatever it says. A plugin that fails to
        import is recorded in :attr:`failures` and logged, never fatal here.
        """
        for dist in md.distributions():
            dist_name = dist.metadata["Name"]
            if allow is not None and _norm(dist_name) not in allow | {BUILTIN_DISTRIBUTION}:
                continue
            for ep in dist.entry_points:
                if ep.group != GROUP:
                    continue
                plugin_name = f"{dist_name}:{ep.name}"
                if self.pm.has_plugin(plugin_name):
                    continue
                try:
                    module = ep.load()
                    self.add_plugin(module, plugin_name, distribution=dist_name, version=dist.version)
                except Exception as e:
                    error = str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
                    self.import_failures.append(LoadFailure(plugin_name, dist_name, dist.version, error))
                    logger.warning("plugin %s from %s %s failed to load: %s", ep.name, dist_name, dist.version, error)

    def add_plugin(
        self, plugin: object, name: str, *, distribution: str = "<local>", version: str = "0"
    ) -> None:
        """Register a plugin object (a module or any object with hookimpls). One that declares
        a plugin API version (``MODSERVE_PLUGIN_API``) this modserve does not provide is refused."""
        check_api_version(getattr(plugin, "MODSERVE_PLUGIN_API", None), name, distribution, version)
        self.pm.register(plugin, name=name)
        self.pm.check_pending()  # a misspelled hook name fails here, not silently
        self._dists[name] = (distribution, version)
        self._by_kind = None

    def remove_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._dists.pop(name, None)
        self._by_kind = None

    def sources(self) -> list[str]:
        """Where this registry's plugins came from, for another process to load the same: the
        distributions of entry-point plugins, ``module:NAME`` for modules added directly."""
        out = {_norm(dist) for dist, _ in self._dists.values() if dist != "<local>"}
        for name, plugin in self.pm.list_name_plugin():
            if self._dists.get(name, ("<local>",))[0] == "<local>" and isinstance(plugin, types.ModuleType):
                out.add(f"module:{plugin.__name__}")
        return sorted(out)

    @property
    def failures(self) -> list[LoadFailure]:
        """Plugins that failed to import, or whose ``register_*`` hook raised."""
        self.registrations()
        return self.import_failures + self._hook_failures

    @contextlib.contextmanager
    def plugin(self, plugin: object, name: str, **kw: str) -> Iterator[None]:
        """Register ``plugin`` for the duration of a ``with`` block (tests)."""
        self.add_plugin(plugin, name, **kw)
        try:
            yield
        finally:
            self.remove_plugin(name)

    # -- what was registered ----------------------------------------------
    def registrations(self) -> dict[str, dict[str, Registration]]:
        if self._by_kind is None:
            self._by_kind = self._collect()
        return self._by_kind

    def _collect(self) -> dict[str, dict[str, Registration]]:
        by_kind: dict[str, dict[str, Registration]] = {k: {} for k in hookspecs.KIND_HOOKS}
        self._hook_failures = []
        broken: set[str] = set()  # plugins whose hook raised: none of their names count
        for kind, hook_name in hookspecs.KIND_HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            # Call each implementation on its own so every name is attributed to its plugin.
            for impl in hook.get_hookimpls():
                if impl.plugin_name in broken:
                    continue
                dist, version = self._dists.get(impl.plugin_name, ("<local>", "0"))
                mine: dict[str, Registration] = {}

                def register(
                    name: str,
                    target: str | Callable[[], Any],
                    *,
                    options: type[BaseModel] | str | None = None,
                    description: str = "",
                    priority: dict[str, int] | None = None,
                    _kind: str = kind,
                    _plugin: str = impl.plugin_name,
                    _dist: str = dist,
                    _version: str = version,
                ) -> None:
                    new = Registration(_kind, name, target, options, description, _plugin, _dist, _version,
                                       dict(priority or {}))
                    old = by_kind[_kind].get(name) or mine.get(name)
                    if old is not None:
                        raise PluginError(
                            f"{_kind} {name!r} is registered twice: by {old.origin} and by {new.origin}"
                        )
                    mine[name] = new

                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as e:  # recorded like a failed import: the other plugins still work
                    error = f"{hook_name} raised {type(e).__name__}: {e}"
                    self._hook_failures.append(LoadFailure(impl.plugin_name, dist, version, error))
                    logger.warning("plugin %s from %s %s failed to load: %s", impl.plugin_name, dist, version, error)
                    broken.add(impl.plugin_name)
                    continue
                by_kind[kind].update(mine)
        for regs in by_kind.values():  # what a broken plugin registered under an earlier kind goes too
            for name in [n for n, r in regs.items() if r.plugin in broken]:
                del regs[name]
        return by_kind

    def names(self, kind: str) -> list[str]:
        return sorted(self.registrations()[_check_kind(kind)])

    def get(self, kind: str, name: str) -> Registration:
        """The registration of ``name``; an unknown name lists the available ones."""
        found = self.registrations()[_check_kind(kind)].get(name)
        if found is None:
            available = ", ".join(self.names(kind)) or "none"
            msg = f"unknown {kind} {name!r}; available: {available}"
            if self.failures:
                msg += "; plugins that failed to load: " + "; ".join(
                    f"{f.distribution} {f.version}: {f.error}" for f in self.failures
                )
            raise ValueError(msg)
        return found

    def load(self, kind: str, name: str) -> Any:
        return self.get(kind, name).load()

    def create(self, kind: str, choice: Any, *args: Any, **kwargs: Any) -> Any:
        """Construct the implementation a :class:`~modserve.core.config.PluginChoice` selects,
        passing its validated options as ``options=``. The instance is marked with its
        registration (:func:`registration_of`): the core's errors about it name the plugin."""
        return self.get(kind, choice.name).create(choice.options, *args, **kwargs)

    def describe(self) -> list[dict[str, Any]]:
        """Every distribution, its version and what it registered per kind."""
        dists: dict[str, dict[str, Any]] = {}
        for plugin_name, (dist, version) in self._dists.items():
            dists.setdefault(dist, {"distribution": dist, "version": version, "plugins": [], "registered": {}})
            dists[dist]["plugins"].append(plugin_name)
        for kind, regs in self.registrations().items():
            for reg in regs.values():
                entry = dists.setdefault(
                    reg.distribution,
                    {"distribution": reg.distribution, "version": reg.version, "plugins": [], "registered": {}},
                )
                entry["registered"].setdefault(kind, []).append(reg.name)
        for f in self.failures:
            dists.setdefault(
                f.distribution, {"distribution": f.distribution, "version": f.version, "plugins": [], "registered": {}}
            ).setdefault("errors", []).append(f.error)
        return sorted(dists.values(), key=lambda d: d["distribution"])


def mark(obj: object, reg: Registration | None) -> None:
    """Record which registration made ``obj``, so errors at the core's seams can name it."""
    with contextlib.suppress(AttributeError, TypeError):  # __slots__ or a builtin: left unnamed
        setattr(obj, _MADE_BY, reg)


def registration_of(obj: object) -> Registration | None:
    """The registration whose implementation made ``obj`` (see :func:`mark`); None if unknown."""
    return getattr(obj, _MADE_BY, None)


_MADE_BY = "_modserve_registration"


def check_api_version(declared: object, plugin: str, distribution: str, version: str) -> None:
    """Refuse a plugin written for a plugin API this modserve does not provide: another major
    version, or a newer minor one (it may use what this one lacks). None: undeclared, accepted."""
    if declared is None:
        return
    major, minor = (int(p) for p in hookspecs.PLUGIN_API_VERSION.split("."))
    try:
        want_major, want_minor = (int(p) for p in str(declared).split("."))
    except ValueError:
        raise PluginError(f"plugin {plugin!r} from {distribution} {version} declares MODSERVE_PLUGIN_API="
                          f"{declared!r}; expected \"major.minor\", e.g. \"{hookspecs.PLUGIN_API_VERSION}\"") from None
    if want_major != major or want_minor > minor:
        raise PluginError(f"plugin {plugin!r} from {distribution} {version} was written for plugin API {declared}; "
                          f"this modserve provides {hookspecs.PLUGIN_API_VERSION} and loads plugins written for "
                          f"{major}.0 to {major}.{minor}: install a version of it made for this modserve")


def _check_kind(kind: str) -> str:
    if kind not in hookspecs.KIND_HOOKS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(hookspecs.KIND_HOOKS)}")
    return kind


def _import_target(target: Any) -> Any:
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj
    if callable(target) and not isinstance(target, type):
        return target()
    return target


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def allowed_distributions() -> set[str] | None:
    """Third-party distributions named by ``MODSERVE_LOAD_PLUGINS``; None when it is unset."""
    raw = os.environ.get(ENV_ALLOWLIST)
    if raw is None:
        return None
    return {_norm(p.strip()) for p in raw.split(",") if p.strip()}


_default: Registry | None = None
_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loading entry points on first use."""
    global _default
    with _lock:
        if _default is None:
            reg = Registry()
            reg.load_entrypoints(allowed_distributions())
            _default = reg
        return _default


def reset_registry() -> None:
    """Forget the process-wide registry; the next :func:`get_registry` reloads (tests)."""
    global _default
    with _lock:
        _default = None
