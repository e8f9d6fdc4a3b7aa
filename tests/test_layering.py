"""The layers hold: the core imports no implementation, and the built-in plugins use
only what the core offers every plugin (its public modules), as a third party must.

Read from the source (every import statement, at any depth), so a lazy import
inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "modserve"
IMPLEMENTATION_PACKAGES = ("plugins", "attention_backends", "quantizers", "samplers")
# The core modules a plugin may import: the contracts and the data they pass around.
# Everything else under modserve.core (engine, runner, scheduler mechanism, batch
# building, loader, registry internals) is the core's own and may change any day.
PLUGIN_API = {
    "modserve.core.hookspecs",  # hookimpl, Register
    "modserve.core.interfaces",  # the ABCs and the dataclasses they exchange
    "modserve.core.sequence",  # what schedulers, allocators and proposers read
    "modserve.core.sampling_params",
    "modserve.core.structured_outputs",  # a grammar backend's spec
    "modserve.core.forward_context",  # a model's attention call
    "modserve.core.linear",  # the linear factory models build with and quantizers extend
    "modserve.core.speculative",  # sample_rows: one sampling primitive for samplers and drafts
    "modserve.core.spec_decode",
}


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every modserve import in ``path`` (a module of ``package``),
    relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if (ROOT.parent / base.replace(".", "/")).is_dir():  # from a package: its submodules
                found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, base))
    return sorted((line, m) for line, m in found if m == "modserve" or m.startswith("modserve."))


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])


def _modules(subpackage: str) -> list[Path]:
    return sorted((ROOT / subpackage).rglob("*.py"))


def _is_deprecated_shim(path: Path) -> bool:
    # An old path kept importable for third parties: it only re-exports the new one.
    return "DeprecationWarning" in path.read_text()


def _past_the_api(path: Path, package: str) -> list[str]:
    return [f"{path.name}:{line} imports {m}" for line, m in _imports(path, package)
            if m.startswith("modserve.core") and m not in PLUGIN_API]


def test_core_imports_no_implementation():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {m}"
           for p in _modules("core") if not _is_deprecated_shim(p)
           for line, m in _imports(p, _package_of(p))
           if any(m == f"modserve.{pkg}" or m.startswith(f"modserve.{pkg}.") for pkg in IMPLEMENTATION_PACKAGES)]
    assert not bad, "core must not know its implementations:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", IMPLEMENTATION_PACKAGES)
def test_builtin_plugins_use_only_the_plugin_api(package):
    bad = [v for p in _modules(package) for v in _past_the_api(p, _package_of(p))]
    assert not bad, ("a built-in plugin reaches into the core past the plugin API "
                     f"({', '.join(sorted(PLUGIN_API))}):\n" + "\n".join(bad))


def test_the_check_sees_a_planted_lazy_and_relative_import(tmp_path):
    planted = tmp_path / "plugin.py"
    planted.write_text("from modserve.core import interfaces  # the API: allowed\n"
                       "def f():\n    from modserve.core.model_runner import ModelRunner\n"
                       "from ...core.engine import LLMEngine\n")
    assert _past_the_api(planted, "modserve.plugins.fake") == [
        "plugin.py:3 imports modserve.core.model_runner",
        "plugin.py:4 imports modserve.core.engine"]
