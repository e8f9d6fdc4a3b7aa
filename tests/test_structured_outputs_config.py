"""vLLM's ``--structured-outputs-config`` JSON on modserve's grammar_backend and reasoning_parser
(modserve/vllm_compat.py): what each key becomes, and a clear error for what modserve lacks."""

from __future__ import annotations

import json

import pytest

from modserve import cli
from modserve.plugins.grammars.outlines_backend import OutlinesOptions
from modserve.plugins.grammars.xgrammar_backend import XGrammarOptions
from modserve.vllm_compat import engine_config

OPTIONS = {"xgrammar": XGrammarOptions, "outlines": OutlinesOptions}


def resolve(llama_dir: str, config: dict) -> tuple:
    """The grammar_backend and reasoning_parser a `modserve generate` command line resolves to."""
    args = cli.build_parser().parse_args(["generate", llama_dir, "--prompt", "x",
                                          "--structured-outputs-config", json.dumps(config)])
    c = cli.config_from_args(args)
    return c.grammar_backend.model_dump(), c.reasoning_parser and c.reasoning_parser.name


@pytest.mark.parametrize("config, backend, options, parser", [
    ({"backend": "xgrammar"}, "xgrammar", {}, None),
    ({"backend": "xgrammar", "disable_any_whitespace": True}, "xgrammar", {"any_whitespace": False}, None),
    ({"backend": "xgrammar", "disable_any_whitespace": False, "disable_fallback": True}, "xgrammar",
     {"any_whitespace": True}, None),
    ({"backend": "outlines", "disable_any_whitespace": True}, "outlines", {"whitespace_pattern": ""}, None),
    ({"backend": "outlines", "disable_any_whitespace": False}, "outlines", {}, None),
    ({"backend": "auto", "reasoning_parser": "qwen3"}, "auto", {}, "qwen3"),
    ({}, "auto", {}, None),
])
def test_each_key_maps_onto_the_grammar_backend(llama_dir, config, backend, options, parser):
    choice, reasoning = resolve(llama_dir, config)
    assert choice == {"name": backend, "options": options} and reasoning == parser
    if backend in OPTIONS:  # the options are the backend's own: its options model takes them
        OPTIONS[backend](**options)


@pytest.mark.parametrize("config, message", [
    ({"backend": "guidance"}, "backend 'guidance' is not one of modserve's; accepted: auto, xgrammar, outlines"),
    ({"backend": "lm-format-enforcer"}, "accepted: auto, xgrammar, outlines"),
    ({"backend": "xgrammar", "enable_in_reasoning": True},
     r"keys modserve does not take: \['enable_in_reasoning'\]; accepted: backend, disable_fallback, "
     "disable_any_whitespace, reasoning_parser"),
    ({"disable_fallback": True}, "disable_fallback needs a named backend"),
    ({"disable_any_whitespace": True}, "disable_any_whitespace needs a named backend"),
    ({"backend": "outlines", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or false"),
    ([1, 2], "expected a JSON object"),
])
def test_what_modserve_lacks_is_an_error_naming_the_accepted(config, message):
    with pytest.raises(ValueError, match=message):
        engine_config({"model": "m", "structured_outputs_config": config})
