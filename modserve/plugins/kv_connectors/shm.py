"""``kv_connector: shm``: every prompt block's KV in a POSIX shared-memory segment.

For engines on one machine (a prefill and a decode server), with no disk: the producer
creates one segment per block and rank, named from the namespace, the rank and the key;
a consumer attaches by name, copies the block out and detaches. A producer unlinks its
segments when it stops (and the oldest ones past ``max_gb``), so none outlives it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from multiprocessing import resource_tracker, shared_memory

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import KVConnectorContext
from modserve.plugins.kv_connectors.block_store import BlockStore


_MADE_HERE: set[str] = set()  # segments this process created (and the resource tracker tracks)


class SharedMemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_gb: float = Field(4.0, gt=0, description="Shared memory this engine's segments may take; the oldest "
                          "are unlinked past it")


class SharedMemoryConnector(BlockStore):
    def __init__(self, context: KVConnectorContext, options: SharedMemoryOptions | None = None) -> None:
        super().__init__(context, options or SharedMemoryOptions())
        self.prefix = "ms" + hashlib.sha256(context.namespace.encode()).hexdigest()[:12]
        self.owned: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()  # oldest first

    def _name(self, key: str, rank: int) -> str:
        return f"{self.prefix}r{rank}{key[:40]}"  # well under NAME_MAX; 160 bits of the chain

    def _attach(self, key: str, rank: int) -> shared_memory.SharedMemory | None:
        try:
            segment = shared_memory.SharedMemory(self._name(key, rank))
        except FileNotFoundError:
            return None
        # NOTE: Python 3.11 tracks attached segments too and would unlink the producer's at
        # this process's exit; the producer owns them (unless it is this process).
        if segment._name not in _MADE_HERE:
            resource_tracker.unregister(segment._name, "shared_memory")
        return segment

    def has(self, key: str, rank: int) -> bool:
        if rank == self.context.tp_rank and key in self.owned:
            return True
        segment = self._attach(key, rank)
        if segment is None:
            return False
        written = int.from_bytes(segment.buf[:8], "little") > 0  # its size is written last
        segment.close()
        return written

    def read(self, key: str) -> bytes | None:
        segment = self._attach(key, self.context.tp_rank)
        if segment is None:
            return None
        try:
            size = int.from_bytes(segment.buf[:8], "little")
            return bytes(segment.buf[8:8 + size])
        finally:
            segment.close()

    def write(self, key: str, payload: bytes) -> None:
        if key in self.owned:
            self.owned.move_to_end(key)
            return
        name = self._name(key, self.context.tp_rank)
        try:
            segment = shared_memory.SharedMemory(name, create=True, size=8 + len(payload))
        except FileExistsError:  # another engine holds this block already
            return
        # Size first, then the bytes: a reader that finds a short or partial payload fails its checksum.
        segment.buf[8:8 + len(payload)] = payload
        segment.buf[:8] = len(payload).to_bytes(8, "little")
        self.owned[key] = segment
        _MADE_HERE.add(segment._name)
        while len(self.owned) * (8 + len(payload)) > self.options.max_gb * 2**30:
            self._unlink(self.owned.popitem(last=False)[1])

    def close(self) -> None:
        while self.owned:
            self._unlink(self.owned.popitem()[1])

    @staticmethod
    def _unlink(segment: shared_memory.SharedMemory) -> None:
        segment.close()
        segment.unlink()
        _MADE_HERE.discard(segment._name)
