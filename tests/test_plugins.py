"""The plugin door: registration, selection by config, errors that name names, third-party packages."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

from modserve import LLM, SamplingParams
from modserve.config_files import config_from_file
from modserve.core.config import EngineConfig
from modserve.core.hookspecs import hookimpl
from modserve.core.registry import PluginError, Registry, get_registry

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def builtin_registry() -> Registry:
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    return reg


def fake_plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


class CountingAttention:
    """A plugin backend: the reference backend, counting its calls."""

    calls = 0

    def __new__(cls, spec, options=None):
        from modserve.attention_backends.reference import ReferenceAttention

        class Counting(ReferenceAttention):
            def forward(self, *args):
                CountingAttention.calls += 1
                return super().forward(*args)

        return Counting(spec, options)


def test_builtins_register_through_entry_points():
    reg = builtin_registry()
    assert {"reference", "paged"} <= set(reg.names("attention_backend"))
    assert reg.names("kv_allocator") == ["contiguous", "paged", "radix"]
    assert reg.names("scheduler") == ["fcfs", "lpm", "priority", "static"]
    assert reg.names("sampler") == ["default"]
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(reg.names("model_architecture"))
    assert all(r.distribution == "modserve" for kind in reg.registrations().values() for r in kind.values())


def test_registration_imports_nothing_heavy():
    code = ("import sys; from modserve.core.registry import get_registry; r = get_registry(); "
            "r.registrations(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"MODSERVE_LOAD_PLUGINS": "modserve", "PATH": ""})
    assert out.stdout.strip() == "False"


def test_fake_plugin_selected_from_config(llama_dir, tmp_path):
    reg = builtin_registry()
    plugin = fake_plugin(register_attention_backends=lambda register: register("counting", CountingAttention))
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"model: {llama_dir}\nattention_backend: counting\nnum_kv_blocks: 128\ndtype: float32\n")
    with reg.plugin(plugin, "test-counting", distribution="test-dist", version="1.2"):
        llm = LLM.from_config(cfg, registry=reg, progress=False)
        CountingAttention.calls = 0
        llm.generate(["hello"], GREEDY, use_tqdm=False)
        assert CountingAttention.calls > 0
        assert reg.get("attention_backend", "counting").origin.startswith("test-dist 1.2")
    assert "counting" not in reg.names("attention_backend")


def test_duplicate_name_names_both_distributions():
    reg = builtin_registry()
    plugin = fake_plugin(register_attention_backends=lambda register: register("paged", CountingAttention))
    reg.add_plugin(plugin, "dup", distribution="modserve-evil", version="6.6.6")
    with pytest.raises(PluginError, match=r"registered twice: by modserve 0\..*modserve-evil 6\.6\.6"):
        reg.registrations()


def test_unknown_name_lists_available(llama_dir):
    with pytest.raises(ValueError, match=r"unknown attention_backend 'nope'; available: paged, reference"):
        LLM(llama_dir, attention_backend="nope", num_kv_blocks=128, registry=builtin_registry(), progress=False)


def test_plugin_options_are_validated(llama_dir):
    from pydantic import BaseModel, ConfigDict

    class Opts(BaseModel):
        model_config = ConfigDict(extra="forbid")
        tile: int = 8

    seen = {}

    def factory():
        from modserve.plugins.kv_allocators.paged import PagedAllocator

        class Tiled(PagedAllocator):
            def __init__(self, num_blocks, block_size, max_model_len, options=None):
                super().__init__(num_blocks, block_size, max_model_len)
                seen["tile"] = options.tile

        return Tiled

    reg = builtin_registry()
    plugin = fake_plugin(register_kv_allocators=lambda register: register("tiled", factory, options=Opts))
    reg.add_plugin(plugin, "tiled")
    LLM(llama_dir, kv_allocator={"name": "tiled", "options": {"tile": 32}}, num_kv_blocks=128,
        registry=reg, progress=False)
    assert seen["tile"] == 32
    with pytest.raises(ValueError, match="invalid options for kv_allocator 'tiled'.*colour"):
        LLM(llama_dir, kv_allocator={"name": "tiled", "options": {"colour": 1}}, num_kv_blocks=128,
            registry=reg, progress=False)
    with pytest.raises(ValueError, match="kv_allocator 'contiguous' takes no options"):
        LLM(llama_dir, kv_allocator={"name": "contiguous", "options": {"x": 1}}, num_kv_blocks=128,
            registry=reg, progress=False)
    with pytest.raises(ValueError, match="invalid options for kv_allocator 'paged': unknown option 'x'"):
        LLM(llama_dir, kv_allocator={"name": "paged", "options": {"x": 1}}, num_kv_blocks=128,
            registry=reg, progress=False)


def test_plugin_failing_to_load_names_its_distribution(llama_dir):
    reg = builtin_registry()
    plugin = fake_plugin(register_attention_backends=lambda register: register("broken", "no_such_module_x:Cls"))
    reg.add_plugin(plugin, "broken-plugin", distribution="modserve-broken", version="0.3")
    with pytest.raises(PluginError, match=r"attention_backend 'broken' from modserve-broken 0\.3.*No module named"):
        LLM(llama_dir, attention_backend="broken", num_kv_blocks=128, registry=reg, progress=False)


def test_misspelled_hook_is_refused():
    reg = builtin_registry()
    with pytest.raises(Exception, match="register_atention_backends"):
        reg.add_plugin(fake_plugin(register_atention_backends=lambda register: None), "typo")


def test_load_plugins_env_allowlist_filters_third_parties_only(monkeypatch):
    from modserve.core.registry import reset_registry

    monkeypatch.setenv("MODSERVE_LOAD_PLUGINS", "")  # built-ins only, never nothing at all
    reset_registry()
    assert get_registry().names("attention_backend") == ["paged", "reference", "triton"]
    assert {d["distribution"] for d in get_registry().describe()} == {"modserve"}


def test_config_errors_name_the_key(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'max_model_length'"):
        EngineConfig.from_dict({"model": llama_dir, "max_model_length": 5})
    with pytest.raises(ValueError, match="model directory does not exist: /no/such/dir"):
        EngineConfig.from_dict({"model": "/no/such/dir"})
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_dict({"model": llama_dir, "block_size": 0})
    toml = tmp_path / "c.toml"
    toml.write_text(f'model = "{llama_dir}"\nmax_num_seqs = 3\n[scheduler]\nname = "fcfs"\n')
    cfg = config_from_file(toml, max_num_seqs=5)
    assert cfg.max_num_seqs == 5 and cfg.scheduler.name == "fcfs"
    yml = tmp_path / "c.yaml"
    yml.write_text(f"model: {llama_dir}\nattention_backend: {{name: reference}}\n")
    assert config_from_file(yml).attention_backend.name == "reference"


def test_plugins_command_json():
    out = subprocess.run([sys.executable, "-m", "modserve", "plugins", "--json"], capture_output=True,
                         text=True, check=True, env={"MODSERVE_LOAD_PLUGINS": "modserve", "PATH": ""})
    (dist,) = json.loads(out.stdout)
    assert dist["distribution"] == "modserve"
    assert "paged" in dist["registered"]["attention_backend"]


def test_third_party_package_installed_with_pip(llama_dir, tmp_path, monkeypatch):
    """A real distribution with a `modserve` entry point, pip-installed, selected by config."""
    pkg = tmp_path / "modserve-demo-attn"
    (pkg / "modserve_demo_attn").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "modserve-demo-attn"
        version = "0.4.2"
        [project.entry-points.modserve]
        demo = "modserve_demo_attn"
    """))
    (pkg / "modserve_demo_attn" / "__init__.py").write_text(textwrap.dedent("""
        from modserve.core.hookspecs import hookimpl

        @hookimpl
        def register_attention_backends(register):
            register("demo", "modserve_demo_attn.backend:DemoAttention")
    """))
    (pkg / "modserve_demo_attn" / "backend.py").write_text(textwrap.dedent("""
        from modserve.attention_backends.reference import ReferenceAttention

        CALLS = []

        class DemoAttention(ReferenceAttention):
            def forward(self, q, k, v, kv_cache, meta, state):
                CALLS.append(meta.num_tokens)
                return super().forward(q, k, v, kv_cache, meta, state)
    """))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(pkg)]
    subprocess.run(pip, check=True)
    try:
        cfg = tmp_path / "engine.yaml"
        cfg.write_text(f"model: {llama_dir}\nattention_backend: demo\nnum_kv_blocks: 128\n")
        script = textwrap.dedent(f"""
            from modserve import LLM, SamplingParams
            import modserve_demo_attn.backend as b
            llm = LLM.from_config({str(cfg)!r}, progress=False)
            out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            print(len(b.CALLS) > 0, len(out[0].outputs[0].token_ids))
        """)
        env = {"MODSERVE_LOAD_PLUGINS": "modserve,modserve-demo-attn", "PATH": ""}
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["True", "4"]
        listing = subprocess.run([sys.executable, "-m", "modserve", "plugins", "--json"], capture_output=True,
                                 text=True, check=True, env=env)
        dists = {d["distribution"]: d for d in json.loads(listing.stdout)}
        assert dists["modserve-demo-attn"]["version"] == "0.4.2"
        assert dists["modserve-demo-attn"]["registered"] == {"attention_backend": ["demo"]}
        # Not in the allowlist: not loaded, and the error lists what is available.
        env["MODSERVE_LOAD_PLUGINS"] = "modserve"
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert "unknown attention_backend 'demo'; available: paged, reference" in run.stderr
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "modserve-demo-attn"], check=True)
