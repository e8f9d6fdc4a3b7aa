"""The plugin API as a contract: one lazy public module, a declared version, and hook
failures that cost only the plugin that raised."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import modserve.api as api
from modserve.api import PLUGIN_API_VERSION, PluginError, hookimpl
from modserve.core.registry import Registry


def test_every_public_name_resolves_and_no_submodule_shadows_one():
    assert all(hasattr(api, name) for name in api.__all__)
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(api.__path__)}
    assert not submodules & set(api.__all__), "a submodule import would replace the name on the package"


def test_registering_through_the_api_imports_no_torch():
    code = "import sys\nfrom modserve.api import hookimpl, PLUGIN_API_VERSION\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def builtin_registry() -> Registry:
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    return reg


def _plugin(api_version: object = None, **hooks) -> types.SimpleNamespace:
    impls = {name: hookimpl(fn) for name, fn in hooks.items()}
    plugin = types.SimpleNamespace(**impls)
    if api_version is not None:
        plugin.MODSERVE_PLUGIN_API = api_version
    return plugin


def _registers_sampler(register):
    register("mine", "modserve.samplers.default:DefaultSampler")


@pytest.mark.parametrize("declared", [None, PLUGIN_API_VERSION, PLUGIN_API_VERSION.split(".")[0] + ".0"])
def test_a_plugin_for_this_api_loads(declared):
    reg = Registry()
    reg.add_plugin(_plugin(declared, register_samplers=_registers_sampler), "ok", distribution="ok-dist", version="1")
    assert reg.names("sampler") == ["mine"]


@pytest.mark.parametrize("declared, why", [
    ("0.9", "written for plugin API 0.9"),
    (f"{int(PLUGIN_API_VERSION.split('.')[0]) + 1}.0", "loads plugins written for"),
    (f"{PLUGIN_API_VERSION.split('.')[0]}.{int(PLUGIN_API_VERSION.split('.')[1]) + 1}", "loads plugins written for"),
    ("one", 'expected "major.minor"'),
])
def test_a_plugin_for_another_api_is_refused_by_name(declared, why):
    reg = Registry()
    with pytest.raises(PluginError, match=rf"plugin 'old' from old-dist 2\.1 .*{why}"):
        reg.add_plugin(_plugin(declared, register_samplers=_registers_sampler), "old",
                       distribution="old-dist", version="2.1")


def test_a_raising_register_hook_costs_only_its_plugin():
    reg = builtin_registry()

    def explode(register):
        register("half-done", "modserve.samplers.default:DefaultSampler")
        raise RuntimeError("no GPU here")

    reg.add_plugin(_plugin(register_samplers=explode, register_schedulers=lambda register: register(
        "also-mine", "modserve.plugins.schedulers.fcfs:FCFS")), "explodes", distribution="modserve-boom",
        version="0.1")
    assert "default" in reg.names("sampler") and "fcfs" in reg.names("scheduler")  # the built-ins still work
    assert "half-done" not in reg.names("sampler") and "also-mine" not in reg.names("scheduler")
    [failure] = reg.failures
    assert (failure.distribution, failure.version) == ("modserve-boom", "0.1")
    assert "register_samplers raised RuntimeError: no GPU here" in failure.error
    with pytest.raises(ValueError, match="unknown sampler 'half-done'.*failed to load: modserve-boom 0.1: "
                                         "register_samplers raised RuntimeError"):
        reg.get("sampler", "half-done")
