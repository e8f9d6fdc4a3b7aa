"""The engine's logits processors (config ``logits_processors``): made once, told each step how the
sampled rows changed (a BatchUpdate), and applied by the sampler at vLLM's places
(:class:`~modserve.core.contracts.sampler.SamplingBatch`)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from modserve.core.config import EngineConfig, PluginChoice
from modserve.core.contracts.logits_processor import AddedRequest, BatchUpdate, LogitsProcessor
from modserve.core.plugin_calls import calling, described
from modserve.core.registry import PluginError, Registration, Registry
from modserve.core.sequence import Sequence

KIND = "logits_processor"


class OutputTokens(SequenceABC):
    """A live, read-only view of a sequence's output token ids: it grows as the sequence does."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    def __len__(self) -> int:
        return len(self._seq.token_ids) - self._seq.num_prompt_tokens

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._seq.token_ids[self._seq.num_prompt_tokens:][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("output token index out of range")
        return self._seq.token_ids[self._seq.num_prompt_tokens + (i % n)]


def registration(registry: Registry, choice: PluginChoice) -> Registration:
    """A registered name's registration, or for a class named as vLLM names one (``pkg.mod:Class``
    or ``pkg.mod.Class``) one made here; another unknown name is the registry's error, which
    lists the registered ones."""
    name = choice.name
    if name in registry.names(KIND) or not ("." in name or ":" in name):
        return registry.get(KIND, name)
    module, sep, attr = name.partition(":")
    target = name if sep else ":".join(name.rsplit(".", 1))
    return Registration(KIND, name, target, None, f"the class {name}", "logits_processors", "a class path",
                        "in logits_processors")


def processor_classes(registry: Registry, config: EngineConfig) -> tuple[type[LogitsProcessor], ...]:
    """The classes ``config`` enables (imported), for checking requests' arguments (validate_params)."""
    classes = []
    for choice in config.logits_processors:
        reg = registration(registry, choice)
        cls = reg.load()
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise PluginError(f"{KIND} {reg.name!r} from {reg.origin} is {described(cls)}, not a subclass of "
                              "modserve.api.LogitsProcessor")
        classes.append(cls)
    return tuple(classes)


class LogitsProcessors:
    """The enabled processors, and the sequences of the rows they saw last step."""

    def __init__(self, registry: Registry, config: EngineConfig, device: torch.device, pin_memory: bool) -> None:
        self.classes = processor_classes(registry, config)
        self.all: list[LogitsProcessor] = [registration(registry, c).create(c.options, config, device, pin_memory)
                                           for c in config.logits_processors]
        self.argmax_invariant: tuple[LogitsProcessor, ...] = ()
        self.others: tuple[LogitsProcessor, ...] = ()
        self._rows: list[Sequence] = []

    def __bool__(self) -> bool:
        return bool(self.all)

    def update(self, seqs: list[Sequence]) -> None:
        """Tell each processor how the rows changed since the last step: a row whose sequence is not
        the one it held is removed, then added (``moved`` stays empty); None when nothing changed."""
        old = self._rows
        removed = [i for i, s in enumerate(old) if i >= len(seqs) or seqs[i] is not s]
        added = [AddedRequest(i, s.params, s.prompt_token_ids, OutputTokens(s))
                 for i, s in enumerate(seqs) if i >= len(old) or old[i] is not s]
        update = BatchUpdate(len(seqs), removed, added, ()) if removed or added else None
        self._rows = list(seqs)
        for p in self.all:
            with calling(p, KIND, "update_state()"):
                p.update_state(update)
        if update is not None or not (self.argmax_invariant or self.others):  # is_argmax_invariant may vary
            split = [(p, p.is_argmax_invariant()) for p in self.all]
            self.argmax_invariant = tuple(p for p, inv in split if inv)
            self.others = tuple(p for p, inv in split if not inv)


def apply_processors(logits: torch.Tensor, processors: tuple[LogitsProcessor, ...]) -> torch.Tensor:
    """``logits`` [B, V] through each of ``processors`` in order; a wrong result names the processor."""
    shape = logits.shape
    for p in processors:
        with calling(p, KIND, "apply()"):
            logits = p.apply(logits)
        if not isinstance(logits, torch.Tensor) or logits.shape != shape:
            raise PluginError(f"{KIND} {type(p).__name__!r}: apply() returned {described(logits)}; expected the "
                              f"logits, shape {list(shape)}")
    return logits
