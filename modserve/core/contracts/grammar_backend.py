"""The grammar backend's contract (config key ``structured_outputs_backend``): compile a
request's grammar, then allow or refuse each next token.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from modserve.core.structured_outputs import GrammarSpec


@dataclass(frozen=True, slots=True)
class GrammarVocab:
    """The tokenizer as a grammar backend sees it; built once per engine."""

    # One entry per logits column: the bytes that token adds to the text, or None
    # for ids a grammar never allows (special tokens, ids past the tokenizer's).
    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]  # allowed only where the grammar may end
    key: str  # identifies this vocabulary; part of the compiled-grammar cache key

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)


class GrammarMatcher(ABC):
    """One sequence's progress through a compiled grammar; used on the engine thread.

    Contract: a new matcher is at the grammar's start. ``fill_bitmask`` overwrites
    ``bitmask[row]`` (int32, CPU, ``ceil(V / 32)`` words) so that bit ``t % 32`` of
    word ``t // 32`` is set exactly for the tokens that may come next; EOS ids are
    set only where the grammar may end. ``accept_token`` advances by one token, or
    returns False and changes nothing if the grammar forbids it. Accepting an EOS id
    terminates the matcher (``is_terminated``); it is then never filled again.
    ``rollback(n)`` undoes the last ``n`` accepted tokens, a terminating EOS
    included, for any ``n`` up to the ``max_rollback`` it was made with.
    ``reset`` returns to the start.
    """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def accept_token(self, token_id: int) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def reset(self) -> None: ...


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and makes per-sequence matchers.

    Contract: made when a request first needs it, once in the engine's process and
    once in each grammar compile worker process (``grammar_compile_isolation``). The
    core passes ``compile`` only specs whose kind is in ``kinds``. ``compile`` may be
    slow and runs in a worker, possibly beside other compiles, which may be killed at
    ``grammar_compile_timeout``; it raises ``ValueError`` saying why a spec is refused
    (invalid, or a feature this backend lacks), and that message reaches the user.
    Its result comes back to the engine's process as ``serialize``'s bytes, read by
    ``deserialize`` there (defaults: pickle); the core caches it and shares it between
    requests, so it must never change. ``matcher`` is cheap and runs on the engine thread.
    """

    kinds: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, vocab: GrammarVocab, options: BaseModel | None = None) -> None:
        self.vocab = vocab
        self.options = options

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any, max_rollback: int) -> GrammarMatcher: ...

    def serialize(self, compiled: Any) -> bytes:
        """``compile``'s result as bytes, in the worker process that compiled it."""
        return pickle.dumps(compiled)

    def deserialize(self, data: bytes) -> Any:
        """``serialize``'s bytes as ``compile``'s result again, in the engine's process."""
        return pickle.loads(data)
