"""``kv_connector: host``: a host-memory tier under the device's prefix cache.

Every full prompt block is copied, as its layer is written, into a pool of host memory
(pinned on a GPU) with LRU eviction; a later prompt that the device's prefix cache has
evicted finds its blocks here and copies them back instead of computing them. So the
device cache and this pool are two LRU tiers, the pool the larger and slower one. Each
rank keeps its own heads; the ranks make the same calls, so their pools stay alike.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import BlockTransfer, KVConnector, KVConnectorContext


class HostMemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size_gb: float = Field(4.0, gt=0, description="Host memory for the pool (vLLM's cpu_bytes_to_use, in GiB)")
    num_blocks: int | None = Field(None, gt=0, description="Exact pool size in blocks (overrides size_gb)")


class HostMemoryConnector(KVConnector):
    def __init__(self, context: KVConnectorContext, options: HostMemoryOptions | None = None) -> None:
        super().__init__(context, options or HostMemoryOptions())
        self.slots: OrderedDict[str, int] = OrderedDict()  # key -> pool slot, least recently used first
        self.counters = {"host_hit_blocks": 0, "bytes_to_host": 0, "bytes_from_host": 0, "evicted_blocks": 0}

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        layers = self.context.layers
        cache = kv_caches[layers[0]]
        self.block_bytes = cache[:, 0].numel() * cache.element_size() * len(layers)
        n = self.options.num_blocks or max(1, int(self.options.size_gb * 2**30 // self.block_bytes))
        # [slots, L, 2, ...block]: one slot is a block of every layer of this rank.
        # Empty, not zeros: pages of a CPU pool are committed only as blocks are saved into them.
        self.pool = torch.empty((n, len(layers), 2, *cache.shape[2:]), dtype=cache.dtype,
                                pin_memory=cache.device.type == "cuda")
        self.free = list(range(n - 1, -1, -1))
        self.saving: dict[str, int] = {}  # this step's saves: key -> slot
        self.last_layer: dict[str, int] = {}  # this step's saves: key -> the last layer copied

    def stored_blocks(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if key not in self.slots:
                return i
            self.slots.move_to_end(key)  # asked for: a use, for the LRU
        return len(keys)

    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = []
        for i, t in enumerate(transfers):
            slot = self.slots.get(t.key)
            if slot is None:  # evicted since it was counted (this step's saves made room)
                failed.append(i)
                continue
            for li, layer in enumerate(self.context.layers):
                cache = self.kv_caches[layer]
                cache[:, t.block_id] = self.pool[slot, li].to(cache.device, non_blocking=True)
            self.counters["host_hit_blocks"] += 1
            self.counters["bytes_from_host"] += self.block_bytes
        return failed

    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        li = self.context.layers.index(layer)
        for t in transfers:
            slot = self.saving.get(t.key)
            if slot is None:
                slot = self.saving[t.key] = self._take_slot(t.key)
            if slot >= 0:
                self.pool[slot, li] = kv_cache[:, t.block_id]
                self.last_layer[t.key] = li

    def finish_saves(self) -> None:
        # The slots are published only now, whole: a block half copied is never found.
        for key, slot in self.saving.items():
            if slot < 0:
                continue
            if self.last_layer.get(key) != len(self.context.layers) - 1:  # a save_layer raised: not whole
                self.free.append(slot)
                continue
            self.slots[key] = slot
            self.counters["bytes_to_host"] += self.block_bytes
        self.saving.clear()
        self.last_layer.clear()

    def _take_slot(self, key: str) -> int:
        """A slot for ``key``: its old one, a free one, or the least recently used one's;
        -1 when every slot holds a block of this step (the pool is smaller than the step)."""
        old = self.slots.pop(key, None)  # saved again (recomputed after an eviction of its parent)
        if old is not None:
            return old
        if not self.free:
            if not self.slots:
                return -1
            _, slot = self.slots.popitem(last=False)
            self.counters["evicted_blocks"] += 1
            return slot
        return self.free.pop()

    def stats(self) -> dict[str, float]:
        return {**self.counters, "host_blocks_total": self.pool.shape[0], "host_blocks_used": len(self.slots)}
