"""Built-in grammar backends, registered through the ``modserve`` entry point like any plugin.

Registration imports neither library; each is imported when a backend is first used.
``auto`` is not registered here: it is the core's choice among these (see
:mod:`modserve.engine.grammar`).
"""

from __future__ import annotations

from modserve.api import Register, hookimpl


# What ``auto`` tries first, per constraint kind. NOTE: regular languages go to
# outlines-core first: its DFA does the same small work per token whatever the regex,
# while xgrammar's Earley matcher can slow down with every token on an ambiguous one,
# stalling every step of the engine (docs/guided-decoding.md has the figures).
# Everything else: xgrammar, which enforces more of JSON Schema and takes grammars.
XGRAMMAR_PRIORITY = {"json": 20, "json_object": 20, "grammar": 20, "regex": 10, "choice": 10}
OUTLINES_PRIORITY = {"json": 10, "json_object": 10, "grammar": 10, "regex": 20, "choice": 20}


@hookimpl
def register_grammar_backends(register: Register) -> None:
    register(
        "xgrammar",
        "modserve.plugins.grammars.xgrammar_backend:XGrammarBackend",
        options="modserve.plugins.grammars.xgrammar_backend:XGrammarOptions",
        description="xgrammar: JSON schema, regex, EBNF/GBNF grammars, choice, any JSON object",
        priority=XGRAMMAR_PRIORITY,
    )
    register(
        "outlines",
        "modserve.plugins.grammars.outlines_backend:OutlinesBackend",
        options="modserve.plugins.grammars.outlines_backend:OutlinesOptions",
        description="outlines-core: JSON schema, regex and choice, compiled to a token-level DFA",
        priority=OUTLINES_PRIORITY,
    )
