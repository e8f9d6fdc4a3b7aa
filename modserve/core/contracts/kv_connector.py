"""The KV connector's contract (config key ``kv_connector``): where KV blocks go past the
local cache (another engine, a store), and what each step loads and saves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel

from modserve.core.contracts.attention_backend import AttentionSpec

KVRole = Literal["producer", "consumer", "both"]


@dataclass(frozen=True, slots=True)
class KVConnectorContext:
    """What a KV connector knows of the engine it serves; every rank makes its own."""

    role: KVRole  # producer: saves only; consumer: loads only; both
    spec: AttentionSpec  # this rank's heads, the cache dtype
    layers: range  # the layers this rank caches
    # The checkpoint, the backend's block layout and the parallel layout in one string:
    # blocks saved under another one never match (they would be another model's KV or bytes).
    namespace: str
    tp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One full block of a prompt to load into, or save from, the paged cache."""

    key: str  # its content: a hash chained over the prompt's tokens up to the block's end
    block_id: int  # where it is in this engine's cache
    # A load's: where its request says the block is (vLLM's ``kv_transfer_params`` of a decode
    # request, checked by the server); None: the connector's configured store.
    remote: dict[str, Any] | None = None


class KVConnector(ABC):
    """Moves full prompt blocks of KV between this engine's paged cache and a store outside
    it (files, shared memory, host memory, another engine), keyed by content.

    One class on two sides, as vLLM's ``KVConnectorBase_V1``: rank 0's instance also
    answers the scheduler (``stored_blocks``); every rank's instance moves its own layers
    and heads. A block is ``kv_cache[layer][:, block_id]`` (dimension 1 of every backend's
    cache is the block), so a connector sees blocks, not models.

    The core calls, per step: ``load`` before the forward for the blocks of newly
    admitted sequences the store holds (a sequence whose load fails is recomputed or
    failed, per ``kv_load_failure_policy``); ``save_layer`` as each layer's attention
    has written the step's KV, for the full prompt blocks complete by the end of the
    step; ``finish_saves`` after the forward. A save must be loadable once
    ``finish_saves`` returns, and must never be seen half written. A save that raises
    (a full disk) costs its blocks, never a request: the core logs and counts it, offers
    none of the step's later layers, and still calls ``finish_saves``, which must then
    store only blocks whose every layer it took.
    """

    def __init__(self, context: KVConnectorContext, options: BaseModel | None = None) -> None:
        self.context = context
        self.options = options

    # -- scheduler side (rank 0) --------------------------------------------------------
    @abstractmethod
    def stored_blocks(self, keys: list[str]) -> int:
        """How many leading blocks of this key chain every rank could load now."""

    def stored_blocks_from(self, keys: list[str], remote: dict[str, Any]) -> int:
        """``stored_blocks`` for a request that names where its blocks are (``remote``: its
        ``kv_transfer_params``, e.g. a producer's address). Default: a store found by content
        alone ignores it."""
        return self.stored_blocks(keys)

    def transfer_params(self) -> dict[str, Any] | None:
        """What a producer's response tells a consumer's request (vLLM's ``kv_transfer_params``
        of a prefill response, e.g. this producer's address), or None: a consumer needs nothing
        more to find the blocks (a shared store)."""
        return None

    # -- worker side (every rank) -------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The paged cache, one tensor per layer (empty for other ranks' layers), once."""
        self.kv_caches = kv_caches

    @abstractmethod
    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        """Copy each block from the store into the cache, for this rank's layers; return
        the indices of the transfers that failed (missing, corrupt): the core drops their
        sequences' blocks, so a failed one may leave its block half written."""

    @abstractmethod
    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        """Take these blocks of one layer's cache (``kv_cache_shape``), just written."""

    def finish_saves(self) -> None:
        """Make this step's saves loadable (after the forward). Default: nothing left."""

    def close(self) -> None:
        """The engine stops: release what the connector holds (segments, temp files)."""

    def stats(self) -> dict[str, float]:
        """Counters for engine stats and /metrics (bytes moved, hits)."""
        return {}
