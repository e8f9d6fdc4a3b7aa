"""What rank 0 asks the other ranks to do: one message per call every rank makes.

Rank 0 broadcasts each message on the ranks' gloo group (pickled), then carries it out
itself; ranks > 0 carry out each one they receive (:meth:`ModelRunner.handle
<modserve.runner.model_runner.ModelRunner.handle>`) until :class:`Stop`. A step sends one
:class:`RunModel`, and a :class:`LoadKV` before it when the KV connector loads blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modserve.core.contracts.attention_backend import AttentionMetadata
from modserve.core.contracts.kv_connector import BlockTransfer
from modserve.runner.lora import LoRAStep


@dataclass(frozen=True, slots=True)
class AllocateKVCache:
    """Allocate the KV cache (zeroed) and the host swap space, then capture the platform's graphs."""

    num_blocks: int
    num_host_blocks: int = 0


@dataclass(frozen=True, slots=True)
class LoadKV:
    """The KV connector loads these blocks into the cache; every rank answers the indices of
    those that failed on any rank."""

    transfers: list[BlockTransfer]


@dataclass(frozen=True, slots=True)
class RunModel:
    """One step's tensor work: its block moves, the forward (the KV connector saving
    ``kv_saves`` as each layer writes them), and the logits of each set of rows."""

    input_ids: torch.Tensor  # [T] int64, every sequence's new tokens back to back
    meta: AttentionMetadata
    # [R] int64 rows of the hidden states per set whose logits rank 0 samples from: the
    # sampled sequences', the speculating ones', the prompt logprobs'
    logit_rows: list[torch.Tensor]
    copies: list[tuple[int, int]] = field(default_factory=list)  # device block -> device block
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device block -> host block
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # host block -> device block
    kv_saves: list[BlockTransfer] = field(default_factory=list)
    lora: LoRAStep | None = None  # enable_lora: the step's adapters and their rows


@dataclass(frozen=True, slots=True)
class ReadStageTimes:
    """Every rank answers the wall time it spent inside its stage's layers (pipeline parallel)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """The engine stops: a rank > 0 lets go of its KV connector and leaves its loop."""


RankMessage = AllocateKVCache | LoadKV | RunModel | ReadStageTimes | Stop
