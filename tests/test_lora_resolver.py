"""The filesystem LoRA resolver's lookups and refusals, and what a server needs before it asks
resolvers at all (the end-to-end check is tests/test_lora.py::test_server_resolves_adapters_by_name)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modserve import EngineConfig, cli
from modserve.plugins.lora_resolvers.filesystem import FilesystemOptions, FilesystemResolver, same_model
from modserve.server.lora_resolve import AdapterResolution, lora_resolution


def _adapter(where: Path, base: str, peft_type: str = "LORA") -> None:
    where.mkdir(parents=True)
    (where / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "base_model_name_or_path": base,
                                                           "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))


def test_filesystem_finds_adapters_by_name_and_nothing_outside(tmp_path, monkeypatch):
    root = tmp_path / "adapters"
    _adapter(root / "sql", "/models/base")
    _adapter(root / "team" / "chat", "/models/base")
    _adapter(root / "other", "/models/another")
    _adapter(root / "prefix", "/models/base", peft_type="PREFIX_TUNING")
    _adapter(tmp_path / "outside", "/models/base")
    resolver = FilesystemResolver(FilesystemOptions(cache_dir=str(root)))
    found = resolver.resolve("/models/base", "sql")
    assert (found.lora_name, found.lora_path) == ("sql", str(root.resolve() / "sql"))
    assert resolver.resolve("/models/base", "team/chat").lora_path == str(root.resolve() / "team" / "chat")
    for name in ("missing", "../outside", "sql/../../outside", str(tmp_path / "outside"), "", ".", "a\x00b"):
        assert resolver.resolve("/models/base", name) is None, name
    with pytest.raises(ValueError, match="'other' was trained on base model '/models/another', not on the served "
                                         "model '/models/base'"):
        resolver.resolve("/models/base", "other")
    with pytest.raises(ValueError, match="'prefix' is a 'PREFIX_TUNING' adapter, not LORA"):
        resolver.resolve("/models/base", "prefix")
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(root))  # vLLM's variable, where cache_dir is unset
    assert FilesystemResolver().resolve("/models/base", "sql").lora_name == "sql"
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR")
    with pytest.raises(ValueError, match="needs its cache_dir option or VLLM_LORA_RESOLVER_CACHE_DIR"):
        FilesystemResolver()
    with pytest.raises(ValueError, match="is not a directory"):
        FilesystemResolver(FilesystemOptions(cache_dir=str(tmp_path / "nowhere")))


def test_the_base_model_matches_by_path_or_hub_id(tmp_path):
    (tmp_path / "ckpt").mkdir()
    snapshot = "/cache/hub/models--Org--Name/snapshots/0123abcd"
    assert same_model("Org/Name", snapshot) and not same_model("Org/Other", snapshot)
    assert same_model(str(tmp_path / "ckpt"), str(tmp_path / "." / "ckpt"))  # one directory, two spellings
    assert not same_model(str(tmp_path), str(tmp_path / "ckpt"))


def test_resolvers_need_lora_and_vllms_runtime_gate(llama_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR", raising=False)
    with pytest.raises(ValueError, match="lora_resolvers needs enable_lora"):
        EngineConfig(model=llama_dir, lora_resolvers=["filesystem"])
    args = cli.build_parser().parse_args(["generate", llama_dir, "--prompt", "x", "--enable-lora", "--lora-resolvers",
                                          "filesystem", f"{{name: filesystem, options: {{cache_dir: {tmp_path}}}}}"])
    config = cli.config_from_args(args)
    assert [(c.name, c.options) for c in config.lora_resolvers] == [
        ("filesystem", {}), ("filesystem", {"cache_dir": str(tmp_path)})]
    with pytest.raises(ValueError, match="set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        lora_resolution(None, config)
    plain = EngineConfig(model=llama_dir, enable_lora=True)
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    assert lora_resolution(None, plain) is None  # vLLM's variable without its gate: ignored, with a warning
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    made = lora_resolution(None, plain)  # the variable alone turns the filesystem resolver on, as in vLLM
    assert isinstance(made, AdapterResolution) and [r.root for r in made.resolvers] == [tmp_path.resolve()]
    with pytest.raises(ValueError, match="unknown lora_resolver 'nope'; available: filesystem"):
        lora_resolution(None, EngineConfig(model=llama_dir, enable_lora=True, lora_resolvers=["nope"]))


def test_a_resolver_that_hangs_costs_its_requests_lora_resolver_timeout(llama_dir):
    """A resolver that never answers: its requests get a 503 naming lora_resolver_timeout once
    it has passed, not a wait as long as the plugin's."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from modserve.server.errors import APIError

    release = threading.Event()

    class Hangs:
        def resolve(self, base_model_name: str, lora_name: str):
            release.wait(30)
            return None

    config = EngineConfig(model=llama_dir, enable_lora=True, lora_resolver_timeout=0.3)
    state = SimpleNamespace(engine=SimpleNamespace(config=config), loras={})
    resolution = AdapterResolution(state, [Hangs()])

    async def ask() -> tuple[APIError, float]:
        started = time.monotonic()
        try:
            await resolution("slow")
        except APIError as e:
            return e, time.monotonic() - started
        finally:
            release.set()  # the hung thread ends, so the loop's executor can shut down
        raise AssertionError("no error")

    error, waited = asyncio.run(ask())
    assert waited < 5
    assert (error.status, error.code, error.param) == (503, "lora_resolver_timeout", "model")
    assert "lora_resolver_timeout=0.3 s" in error.message
