"""``modserve plugins`` (what is installed, with descriptions and options) and ``modserve
conformance`` (the kit's command line)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Sequence

import pytest

from modserve import cli
from modserve.api import hookimpl
from modserve.core import registry as registry_mod
from modserve.core.registry import Registry


def plugins(*args: str) -> str:
    """``modserve plugins`` in a fresh process, built-ins only (an empty allowlist)."""
    run = subprocess.run([sys.executable, "-m", "modserve", "plugins", *args], capture_output=True, text=True,
                         env={"MODSERVE_LOAD_PLUGINS": "", "PATH": ""}, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_json_lists_each_implementation_with_its_description_and_options() -> None:
    (dist,) = json.loads(plugins("--json"))
    assert (dist["distribution"], dist["errors"]) == ("modserve", [])
    regs = {(r["kind"], r["name"]): r for r in dist["registrations"]}
    assert set(regs) == {(kind, name) for kind, names in dist["registered"].items() for name in names}
    fcfs = regs["scheduler", "fcfs"]
    assert fcfs["description"].startswith("continuous batching, first come first served") and fcfs["error"] is None
    options = {o["name"]: o for o in fcfs["options"]}
    assert list(options) == ["chunked_prefill", "long_prefill_token_threshold", "fair_share"]
    assert options["chunked_prefill"] == {"name": "chunked_prefill", "type": "bool", "default": True,
                                          "required": False, "description": "", "constraints": []}
    threshold = options["long_prefill_token_threshold"]
    assert (threshold["type"], threshold["default"], threshold["constraints"]) == ("int", 0, ["ge=0"])
    assert threshold["description"].startswith("At most this many prompt tokens")
    assert regs["attention_backend", "reference"]["options"] == []  # takes none
    (model,) = regs["proposer", "draft_model"]["options"]
    assert (model["name"], model["type"], model["required"], model["default"]) == ("model", "str", True, None)
    kernel = next(o for o in regs["quantizer", "awq"]["options"] if o["name"] == "kernel")
    assert kernel["type"].startswith("Literal['auto', ")


def test_text_groups_by_distribution_and_kind() -> None:
    lines = plugins().splitlines()
    assert lines[0] == "modserve 0.1.0"
    scheduler = lines.index("  scheduler")
    assert lines[scheduler + 1].startswith("    fcfs — continuous batching, first come first served")
    body = "\n".join(lines[scheduler:])
    assert "      options:\n        chunked_prefill (bool) = true\n" in body
    assert "        long_prefill_token_threshold (int, ge=0) = 0\n            At most this many prompt tokens" in body
    reference = lines.index("    reference — Per-sequence SDPA over KV gathered from the cache; slow, for testing")
    assert lines[reference + 1] == "      options: none"
    assert "        model (str) required" in lines


def broken_plugin(tmp_path: Path) -> types.SimpleNamespace:
    """A plugin whose options targets fail in every way they can: a module that is missing,
    one that raises on import, a target that is not a pydantic model; and a second hook that
    raises, which is a load failure of the whole plugin."""
    (tmp_path / "raising_options.py").write_text("raise RuntimeError('options module exploded')\n")
    (tmp_path / "good_options.py").write_text(textwrap.dedent("""
        from pydantic import BaseModel, Field
        class Options(BaseModel):
            depth: int = Field(2, ge=1, description="how deep")
            names: list[str] = Field(default_factory=lambda: ["a"])
    """))

    def register_attention_backends(register: Any) -> None:
        register("good", "x:Y", options="good_options:Options", description="fine")
        register("missing", "x:Y", options="no_such_module_anywhere:Options", description="options missing")
        register("raising", "x:Y", options="raising_options:Options")
        register("not_a_model", "x:Y", options="json:dumps")

    return types.SimpleNamespace(register_attention_backends=hookimpl(register_attention_backends))


def test_broken_options_are_that_implementations_error_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    reg.add_plugin(broken_plugin(tmp_path), "broken", distribution="modserve-broken", version="9.9")

    def raising_hook(register: Any) -> None:
        raise RuntimeError("hook exploded")

    reg.add_plugin(types.SimpleNamespace(register_samplers=hookimpl(raising_hook)), "worse",
                   distribution="modserve-worse", version="1.2")
    monkeypatch.setattr(registry_mod, "_default", reg)  # what get_registry() returns

    assert cli.main(["plugins", "--json"]) == 0
    dists = {d["distribution"]: d for d in json.loads(capsys.readouterr().out)}
    regs = {r["name"]: r for r in dists["modserve-broken"]["registrations"]}
    assert regs["good"]["error"] is None
    assert regs["good"]["options"] == [
        {"name": "depth", "type": "int", "default": 2, "required": False, "description": "how deep",
         "constraints": ["ge=1"]},
        {"name": "names", "type": "list[str]", "default": ["a"], "required": False, "description": "",
         "constraints": []}]
    assert "No module named 'no_such_module_anywhere'" in regs["missing"]["error"]
    assert "options module exploded" in regs["raising"]["error"]
    assert "not a pydantic model class" in regs["not_a_model"]["error"]
    assert all(r["options"] == [] for name, r in regs.items() if name != "good")
    worse = dists["modserve-worse"]
    assert (worse["version"], worse["registrations"]) == ("1.2", [])
    assert worse["errors"] == ["register_samplers raised RuntimeError: hook exploded"]

    assert cli.main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "modserve-broken 9.9\n  attention_backend\n    good — fine\n      options:\n" \
           "        depth (int, ge=1) = 2\n            how deep\n        names (list[str]) = [\"a\"]\n" in text
    assert "    missing — options missing\n      options failed to load: options of attention_backend " \
           "'missing' from modserve-broken 9.9" in text
    assert "modserve-worse 1.2\n  failed to load: register_samplers raised RuntimeError: hook exploded" in text


# -- modserve conformance -------------------------------------------------------------------
def test_conformance_help_explains_targets_and_pytest_args(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["conformance", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "KIND:NAME" in text and "Arguments after -- go to pytest" in text
    assert ("Kinds: attention_backend, kv_allocator, scheduler, sampler, grammar_backend, quantizer, proposer, "
            "executor, kv_connector, tool_parser, reasoning_parser, lora_resolver, logits_processor.") in text


def test_conformance_passes_targets_and_pytest_args_to_the_kit(monkeypatch: pytest.MonkeyPatch) -> None:
    from modserve.testing import conformance

    calls: list[tuple[list[str], list[str]]] = []

    def run(targets: list[str], extra_args: Sequence[str] = ()) -> int:
        calls.append((targets, list(extra_args)))
        return 3  # whatever pytest returned is the command's exit status

    monkeypatch.setattr(conformance, "run", run)
    assert cli.main(["conformance", "scheduler:fcfs", "sampler:default", "--", "-x", "-k", "greedy", "--"]) == 3
    assert cli.main(["conformance", "attention_backend:paged"]) == 3
    assert calls == [(["scheduler:fcfs", "sampler:default"], ["-x", "-k", "greedy", "--"]),
                     (["attention_backend:paged"], [])]


@pytest.mark.parametrize("argv, message", [
    (["conformance"], "the following arguments are required: KIND:NAME"),
    (["conformance", "fcfs"], "'fcfs' is not KIND:NAME"),
    (["conformance", "platform:cpu"], "unknown kind 'platform' in 'platform:cpu'; kinds: attention_backend"),
])
def test_conformance_refuses_malformed_targets(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_conformance_kinds_are_the_kits() -> None:
    from modserve.testing.conformance.targets import KIT_MODULES

    assert set(cli.CONFORMANCE_KINDS) == set(KIT_MODULES)
