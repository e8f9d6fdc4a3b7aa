"""The layers hold, folder by folder:

- ``core`` (contracts, config, registry, request and step data) imports only ``core``, and its
  contracts only each other and the core's data;
- ``runner`` (what every rank runs) imports only ``core`` and itself;
- ``engine`` (rank 0's loop) imports ``core``, ``runner`` and itself;
- ``api`` (the plugin API) re-exports ``core`` and ``runner``;
- the built-in plugins import only ``modserve.api`` and their own kind's folder, as a third
  party must;
- no import circle anywhere in ``modserve``.

Read from the source (every import statement, at any depth), so a lazy import
inside a function counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent / "modserve"
IMPLEMENTATION_PACKAGES = ("plugins", "attention_backends", "quantizers", "samplers")


def _imports(path: Path, package: str, root: Path | None = None) -> list[tuple[int, str]]:
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
            if ((root or ROOT).parent / base.replace(".", "/")).is_dir():  # from a package: its submodules
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


def _own_folder(package: str) -> str:
    """The kind folder a built-in module belongs to: ``modserve.plugins.grammars`` for the
    grammar backends, ``modserve.quantizers`` for the quantizers."""
    parts = package.split(".")
    return ".".join(parts[:3] if parts[1] == "plugins" else parts[:2])


def _past_the_api(path: Path, package: str) -> list[str]:
    own = _own_folder(package)
    return [f"{path.name}:{line} imports {m}" for line, m in _imports(path, package)
            if not (m == "modserve.api" or m.startswith("modserve.api.") or m == own or m.startswith(own + "."))]


# folder -> the modserve packages its modules may import (the folder itself included)
FOLDER_RULES: dict[str, tuple[str, ...]] = {
    "core": ("modserve.core",),
    "core/contracts": ("modserve.core.contracts", "modserve.core.sequence", "modserve.core.structured_outputs",
                       "modserve.core.sampling_params"),
    "runner": ("modserve.core", "modserve.runner"),
    "engine": ("modserve.core", "modserve.runner", "modserve.engine"),
    "api": ("modserve.core", "modserve.runner", "modserve.api"),
}


def _outside(folder: str, allowed: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(ROOT.parent)}:{line} imports {m}"
            for p in _modules(folder) if not _is_deprecated_shim(p)
            for line, m in _imports(p, _package_of(p))
            if not any(m == a or m.startswith(a + ".") for a in allowed)]


@pytest.mark.parametrize("folder", FOLDER_RULES)
def test_each_folder_imports_only_what_it_stands_on(folder):
    bad = _outside(folder, FOLDER_RULES[folder])
    assert not bad, f"modserve/{folder} may import only {FOLDER_RULES[folder]}:\n" + "\n".join(bad)


def test_the_folder_rule_sees_a_planted_import(tmp_path, monkeypatch):
    planted = tmp_path / "modserve" / "core" / "contracts"
    planted.mkdir(parents=True)
    (planted / "leaf.py").write_text("def f():\n    from modserve.runner.linear import Unquantized\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "modserve")
    assert _outside("core/contracts", FOLDER_RULES["core/contracts"]) == [
        "modserve/core/contracts/leaf.py:2 imports modserve.runner.linear"]


def _import_graph(root: Path) -> nx.DiGraph:
    """module -> the modserve modules it imports (at any depth, lazily or not)."""
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
        for _, target in _imports(path, package, root):
            while target not in modules and "." in target:  # a name imported from a module
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def _circles(root: Path) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(_import_graph(root)) if len(c) > 1]


def test_no_import_circle_anywhere():
    circles = _circles(ROOT)
    assert not circles, "modules that import each other (directly or round a circle):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_check_sees_a_planted_lazy_circle(tmp_path):
    package = tmp_path / "modserve"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "a.py").write_text("from modserve.engine.b import f\n")
    (package / "engine" / "b.py").write_text("def f():\n    from modserve.engine.c import g\n")
    (package / "engine" / "c.py").write_text("from modserve.engine import a\n")
    assert _circles(package) == [["modserve.engine.a", "modserve.engine.b", "modserve.engine.c"]]


@pytest.mark.parametrize("package", IMPLEMENTATION_PACKAGES)
def test_builtin_plugins_use_only_the_plugin_api(package):
    bad = [v for p in _modules(package) for v in _past_the_api(p, _package_of(p))]
    assert not bad, ("a built-in plugin imports past the plugin API (modserve.api) and its own "
                     "kind's folder:\n" + "\n".join(bad))


def test_the_check_sees_a_planted_lazy_and_relative_import(tmp_path):
    planted = tmp_path / "plugin.py"
    planted.write_text("from modserve.api import Scheduler  # the API: allowed\n"
                       "from modserve.plugins.fake.helpers import x  # its own folder: allowed\n"
                       "def f():\n    from modserve.runner.model_runner import ModelRunner\n"
                       "from ...core.interfaces import Scheduler\n"
                       "from modserve.plugins.schedulers.fcfs import FCFS\n")
    assert _past_the_api(planted, "modserve.plugins.fake") == [
        "plugin.py:4 imports modserve.runner.model_runner",
        "plugin.py:5 imports modserve.core.interfaces",
        "plugin.py:6 imports modserve.plugins.schedulers.fcfs"]


# Raw lines per folder (blank lines, comments and docstrings count: it is what a reader reads).
FOLDER_BUDGETS: dict[str, tuple[int, str]] = {
    "core": (2500, "what every other folder stands on, read first: one contract per kind, the "
                   "registry and hookspecs, config, the request, sequence and step data"),
    "engine": (2300, "rank 0: the engine loop, the scheduler core, culprit isolation, the output "
                     "processor, speculative planning, grammar compiles and their worker processes"),
    "runner": (2000, "every rank: the model runner, batch building, the forward context, the linear "
                     "factory, collectives, the loader, sampling and rejection sampling"),
}
ENGINE_LOOP_LINES = 400  # modserve/engine/engine.py: the loop reads in one sitting
MAX_FUNCTION_LINES = 40  # each of its functions fits on a screen


@pytest.mark.parametrize("folder", FOLDER_BUDGETS)
def test_each_folder_stays_within_its_budget(folder):
    budget, why = FOLDER_BUDGETS[folder]
    lines = sum(len(p.read_text().splitlines()) for p in _modules(folder))
    assert lines <= budget, f"modserve/{folder} has {lines} lines, over its budget of {budget} ({why})"


def _long_functions(source: str, limit: int) -> list[str]:
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_engine_loop_is_short_and_so_are_its_functions():
    source = (ROOT / "engine" / "engine.py").read_text()
    assert len(source.splitlines()) <= ENGINE_LOOP_LINES
    long = _long_functions(source, MAX_FUNCTION_LINES)
    assert not long, f"functions of engine/engine.py over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_function_length_check_sees_a_long_one():
    body = "".join(f"    x = {i}\n" for i in range(40))
    assert _long_functions(f"def short():\n    pass\n\ndef long():\n{body}", 40) == ["long (41 lines)"]


def test_the_core_holds_no_native_code():
    foreign = [p.relative_to(ROOT.parent) for p in (ROOT / "core").rglob("*")
               if p.is_file() and p.suffix in {".c", ".cc", ".cpp", ".h", ".hpp", ".cu"}]
    assert not foreign, f"the core holds no C/C++ (it belongs to a platform): {foreign}"
