"""The layers hold: the core imports no implementation, and the built-in plugins import
only the plugin API (:mod:`modserve.api`) and their own kind's folder, as a third party must.

Read from the source (every import statement, at any depth), so a lazy import
inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "modserve"
IMPLEMENTATION_PACKAGES = ("plugins", "attention_backends", "quantizers", "samplers")


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


def _own_folder(package: str) -> str:
    """The kind folder a built-in module belongs to: ``modserve.plugins.grammars`` for the
    grammar backends, ``modserve.quantizers`` for the quantizers."""
    parts = package.split(".")
    return ".".join(parts[:3] if parts[1] == "plugins" else parts[:2])


def _past_the_api(path: Path, package: str) -> list[str]:
    own = _own_folder(package)
    return [f"{path.name}:{line} imports {m}" for line, m in _imports(path, package)
            if not (m == "modserve.api" or m.startswith("modserve.api.") or m == own or m.startswith(own + "."))]


def test_core_imports_no_implementation():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {m}"
           for p in _modules("core") if not _is_deprecated_shim(p)
           for line, m in _imports(p, _package_of(p))
           if any(m == f"modserve.{pkg}" or m.startswith(f"modserve.{pkg}.") for pkg in IMPLEMENTATION_PACKAGES)]
    assert not bad, "core must not know its implementations:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", IMPLEMENTATION_PACKAGES)
def test_builtin_plugins_use_only_the_plugin_api(package):
    bad = [v for p in _modules(package) for v in _past_the_api(p, _package_of(p))]
    assert not bad, ("a built-in plugin imports past the plugin API (modserve.api) and its own "
                     "kind's folder:\n" + "\n".join(bad))


def test_the_plugin_api_imports_only_the_core():
    bad = [f"{p.name}:{line} imports {m}" for p in _modules("api") for line, m in _imports(p, _package_of(p))
           if not (m.startswith("modserve.core") or m.startswith("modserve.api"))]
    assert not bad, "modserve.api re-exports the core; it never imports an implementation:\n" + "\n".join(bad)


def test_the_core_never_imports_the_api_facade():
    bad = [f"{p.name}:{line}" for p in _modules("core") for line, m in _imports(p, _package_of(p))
           if m == "modserve.api" or m.startswith("modserve.api.")]
    assert not bad, f"the core must not import modserve.api (it re-exports the core): {bad}"


def test_the_check_sees_a_planted_lazy_and_relative_import(tmp_path):
    planted = tmp_path / "plugin.py"
    planted.write_text("from modserve.api import Scheduler  # the API: allowed\n"
                       "from modserve.plugins.fake.helpers import x  # its own folder: allowed\n"
                       "def f():\n    from modserve.core.model_runner import ModelRunner\n"
                       "from ...core.interfaces import Scheduler\n"
                       "from modserve.plugins.schedulers.fcfs import FCFS\n")
    assert _past_the_api(planted, "modserve.plugins.fake") == [
        "plugin.py:4 imports modserve.core.model_runner",
        "plugin.py:5 imports modserve.core.interfaces",
        "plugin.py:6 imports modserve.plugins.schedulers.fcfs"]


# Lines of code in modserve/core: small enough to read in an afternoon. 3,000 until distributed
# execution added its seam to the core (~320 lines: the layers' tensor-parallel splits and
# collectives, pipeline stages and micro-batches, rank 0's broadcast of each step, starting,
# joining and stopping the ranks); the offline LLM and the workers' loop moved out for ~150.
# 3,300 until the GPU and MoE seams (~40 lines: what a CUDA graph may capture and who captures
# it, the moe_backend kind the models' experts run through). 3,350 until the KV-connector seam
# (~180 lines: its contract, the prefix the store holds past the local cache, the loads and
# their failure policy, the saves as each layer is written, the ranks agreeing on a failure).
# 4,050 with bounded work per request (~470 lines): grammar compiles in worker processes that
# are killed at their time or memory limit (~400, the pool, the worker and the backends'
# serialize/deserialize seam), and the config keys of the request bounds; rank-0 machinery
# such as the compile workers leaves core in the split into core, engine and runner.
CORE_CODE_BUDGET = 4050


def _code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for n, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.lstrip().startswith("#") and n not in docstrings)


def test_the_core_stays_small_and_pure_python():
    core = ROOT / "core"
    foreign = [p.relative_to(ROOT.parent) for p in core.rglob("*")
               if p.is_file() and p.suffix in {".c", ".cc", ".cpp", ".h", ".hpp", ".cu"}]
    assert not foreign, f"the core holds no C/C++ (it belongs to a platform): {foreign}"
    lines = sum(_code_lines(p.read_text()) for p in _modules("core"))
    assert lines <= CORE_CODE_BUDGET, (f"modserve/core has {lines} lines of code, over its budget of "
                                       f"{CORE_CODE_BUDGET}: move what is not core to a plugin or the server")


def test_code_lines_skip_docstrings_comments_and_blanks():
    source = ('"""Module doc\nover two lines."""\n\n# a comment\nx = 1  # code\n\n'
              'def f():\n    """Doc."""\n    return """not a docstring"""\n')
    assert _code_lines(source) == 3  # x = 1, def f, return
