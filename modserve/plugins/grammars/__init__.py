"""Built-in grammar backends, registered through the ``modserve`` entry point like any plugin.

Registration imports neither library; each is imported when a backend is first used.
``auto`` is not registered here: it is the core's choice among these (see
:mod:`modserve.core.grammar`).
"""

from __future__ import annotations

from modserve.core.hookspecs import Register, hookimpl


@hookimpl
def register_grammar_backends(register: Register) -> None:
    register(
        "xgrammar",
        "modserve.plugins.grammars.xgrammar_backend:XGrammarBackend",
        options="modserve.plugins.grammars.xgrammar_backend:XGrammarOptions",
        description="xgrammar: JSON schema, regex, EBNF/GBNF grammars, choice, any JSON object",
    )
    register(
        "outlines",
        "modserve.plugins.grammars.outlines_backend:OutlinesBackend",
        options="modserve.plugins.grammars.outlines_backend:OutlinesOptions",
        description="outlines-core: JSON schema, regex and choice, compiled to a token-level DFA",
    )
