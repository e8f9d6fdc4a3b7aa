"""Compiling one grammar: the backends tried in order, and what a compile made. Shared by the
engine's compiler and its compile worker processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from modserve.core.contracts.grammar_backend import GrammarBackend, GrammarMatcher
from modserve.core.plugin_calls import broke, calling, described, failed
from modserve.core.registry import mark, registration_of
from modserve.core.structured_outputs import GrammarSpec

# Rollback depth every matcher supports: enough for speculative decoding's drafts.
MAX_ROLLBACK = 32
START_TIMEOUT_S = 120.0  # a compile worker process's imports and backends, on a busy machine


class CompilerClosed(RuntimeError):
    """A compile that was queued or running when the compiler shut down."""

    def __init__(self, message: str = "the grammar compiler was shut down") -> None:
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled spec and the backend that made it (and makes its matchers)."""

    backend_name: str
    backend: GrammarBackend
    compiled: Any
    spec: GrammarSpec
    compile_seconds: float

    def matcher(self) -> GrammarMatcher:
        with calling(self.backend, "grammar_backend", "matcher()"):
            matcher = self.backend.matcher(self.compiled, MAX_ROLLBACK)
        if not isinstance(matcher, GrammarMatcher):
            raise broke(self.backend, "grammar_backend", "matcher()", "a GrammarMatcher", described(matcher))
        mark(matcher, registration_of(self.backend))  # its errors name the backend too
        return matcher


def compile_spec(spec: GrammarSpec, names: list[str], backend_of: Callable[[str], GrammarBackend | Exception],
                 single: bool) -> CompiledGrammar:
    """Try the backends ``names`` in order; the first that compiles ``spec`` wins. A
    ValueError gives each one's reason when none does (``single``: just the one's)."""
    reasons = []
    for name in names:
        backend = backend_of(name)
        if isinstance(backend, Exception):
            reasons.append(f"{name}: unavailable ({backend})")
            continue
        if spec.kind not in backend.kinds:
            reasons.append(f"{name}: does not support {spec.kind} constraints")
            continue
        start = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except Exception as e:
            if out_of_memory(e):  # a worker's memory cap: the spec's cost, not the backend's fault
                raise MemoryError(str(e)) from e
            if isinstance(e, ValueError):  # the contract's refusal: its reason is what the user needs
                reasons.append(f"{name}: {e}")
                continue
            raise failed(backend, "grammar_backend", "compile()", e) from e  # the backend's fault
        return CompiledGrammar(name, backend, compiled, spec, time.perf_counter() - start)
    if single:
        raise ValueError(f"{spec.kind} constraint refused: {reasons[0]}")
    raise ValueError(f"no grammar backend accepted this {spec.kind} constraint: " + "; ".join(reasons))


def out_of_memory(error: BaseException) -> bool:
    """A MemoryError, or a C++ library's std::bad_alloc as its bindings raise it."""
    return isinstance(error, MemoryError) or "bad_alloc" in str(error)
