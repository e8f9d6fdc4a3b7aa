"""The docs stay true: every config key and built-in plugin is documented."""

from pathlib import Path

from modserve.core.config import EngineConfig
from modserve.core.registry import Registry

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_config_key_is_in_the_configuration_reference():
    text = (DOCS / "configuration.md").read_text()
    missing = [name for name in EngineConfig.model_fields if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md does not describe: {missing}"


def test_every_builtin_plugin_is_in_the_configuration_reference():
    text = (DOCS / "configuration.md").read_text()
    reg = Registry()
    reg.load_entrypoints({"modserve"})
    missing = [f"{kind} {name}" for kind, regs in reg.registrations().items() if kind != "model_architecture"
               for name in regs if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md does not mention: {missing}"
