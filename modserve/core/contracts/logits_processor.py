"""The logits processor's contract (config key ``logits_processors``, vLLM's ``--logits-processors``):
a batch-level change to the next-token logits, with state kept per batch row.

The method names and their meaning are vLLM v1's (``vllm.v1.sample.logits_processor``), so a
vLLM processor ports by changing its imports and taking ``options``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel

if TYPE_CHECKING:
    from modserve.core.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # row a's request now sits at row b (b's old one is gone)
    SWAP = enum.auto()  # rows a and b exchange their requests


@dataclass(frozen=True, slots=True)
class AddedRequest:
    """A request that takes a batch row. ``output_token_ids`` is a live view: it grows as the
    request generates, so a processor may keep it and read it at each ``apply``."""

    index: int
    params: SamplingParams  # its extra_args hold the request's arguments for processors
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]

    def __iter__(self):  # vLLM's (index, params, prompt_tok_ids, output_tok_ids) tuple unpacks the same
        return iter((self.index, self.params, self.prompt_token_ids, self.output_token_ids))


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """How the batch's rows changed since the last step. Apply in this order: ``removed``,
    ``added`` (an added row may replace one that was there), ``moved``."""

    batch_size: int  # rows this step
    removed: Sequence[int]  # rows whose request left
    added: Sequence[AddedRequest]
    moved: Sequence[tuple[int, int, MoveDirectionality]]  # (a, b, how)


class LogitsProcessor(ABC):
    """Changes a step's logits [B, V] for the rows whose requests enable it.

    Contract: ``update_state`` is called once before every ``apply``, with the rows' changes
    (None when the batch is the same as last step's); a processor keeps what it needs per row
    and reads a request's arguments from ``params.extra_args`` there. ``apply`` returns the
    logits (it may change them in place) with every row it keeps no state for unchanged.
    ``is_argmax_invariant()`` True promises that no row's argmax changes (the sampler then
    skips the processor for greedy rows); False runs it for every row, greedy ones too.
    ``validate_params`` refuses (ValueError starting with the field's name) the arguments of a
    request before it is queued. An instance lives as long as the engine and serves one batch.
    ``examples``: extra_args that make it act on a row, for the conformance kit.
    """

    examples: ClassVar[tuple[dict[str, Any], ...]] = ()

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool,
                 options: BaseModel | None = None) -> None:
        """``config``: the engine's EngineConfig (vLLM's ``vllm_config``); ``options``: the validated
        options block of the config's entry."""
        self.config = config
        self.device = device
        self.options = options

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise a ValueError for arguments (``params.extra_args``) this processor cannot use."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool: ...

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, V] float32 -> [B, V]."""


def extra_arg(params: SamplingParams, key: str, default: Any = None) -> Any:
    """``params.extra_args[key]``, or ``default`` when the request gave none."""
    return (params.extra_args or {}).get(key, default)
