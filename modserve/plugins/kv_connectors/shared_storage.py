"""``kv_connector: shared_storage``: every prompt block's KV in a file under a directory.

Files are ``PATH/NAMESPACE/rank{r}/{key}.kv`` (the namespace names the checkpoint, the
cache layout and the tensor-parallel size; the key is the block's hash chain), each a
CRC32 and the block's bytes. Engines that share the directory share prefills: a producer
writes what a consumer loads, as vLLM's SharedStorageConnector does.

A writer (role producer or both) keeps its rank's directory under ``max_gb / tp_size``,
deleting the blocks least recently written or loaded: it counts what is on disk when it
starts, and a load touches its file, so the order holds across engines and restarts. Other
writers of the same directory are counted at start and, when this one must evict, again at
most every ``RESCAN_S``: in between the directory may exceed the bound by what they wrote.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import KVConnectorContext
from modserve.plugins.kv_connectors.block_store import BlockStore


class SharedStorageOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field("kv_store", description="Directory the blocks are written to and read from "
                      "(vLLM's shared_storage_path)")
    delete_on_close: bool = Field(False, description="Remove the blocks this engine wrote when it stops")
    max_gb: float = Field(4.0, gt=0, description="Disk the blocks of this model and layout may take (split evenly "
                          "among tensor-parallel ranks); a writer deletes the least recently used past it")


RESCAN_S = 10.0  # seconds between recounts of the directory (other writers' blocks) when evicting


class SharedStorageConnector(BlockStore):
    def __init__(self, context: KVConnectorContext, options: SharedStorageOptions | None = None) -> None:
        super().__init__(context, options or SharedStorageOptions())
        self.root = Path(self.options.path).expanduser() / context.namespace
        self.dir = self.root / f"rank{context.tp_rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.written: set[str] = set()
        self.max_bytes = self.options.max_gb * 2**30 / context.tp_size
        self.lru: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self.stored_bytes, self.evicted, self.scanned = 0, 0, 0.0
        if context.role != "consumer":  # a consumer only reads: it bounds nothing
            self._scan()

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.context.role != "consumer" and 4 + self.block_bytes > self.max_bytes:
            raise ValueError(f"kv_connector shared_storage: max_gb {self.options.max_gb} holds not one block "
                             f"({4 + self.block_bytes} bytes per rank)")

    def _scan(self) -> None:
        """Count this rank's directory as it is now (other writers' blocks too), the least
        recently used first by modification time."""
        found = []
        with os.scandir(self.dir) as entries:
            for e in entries:
                try:
                    if e.name.endswith(".kv"):
                        st = e.stat()
                        found.append((st.st_mtime_ns, e.name[:-3], st.st_size))
                except FileNotFoundError:  # another writer evicted it meanwhile
                    pass
        self.lru = OrderedDict((key, size) for _, key, size in sorted(found))
        self.stored_bytes, self.scanned = sum(self.lru.values()), time.monotonic()

    def _make_room(self, size: int) -> None:
        if self.stored_bytes + size > self.max_bytes and time.monotonic() - self.scanned >= RESCAN_S:
            self._scan()
        while self.lru and self.stored_bytes + size > self.max_bytes:
            key, n = self.lru.popitem(last=False)
            self.stored_bytes -= n
            self._file(key, self.context.tp_rank).unlink(missing_ok=True)
            self.written.discard(key)
            self.evicted += 1

    def _file(self, key: str, rank: int) -> Path:
        return self.root / f"rank{rank}" / f"{key}.kv"

    def has(self, key: str, rank: int) -> bool:
        return self._file(key, rank).is_file()

    def read(self, key: str) -> bytes | None:
        path = self._file(key, self.context.tp_rank)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if key in self.lru:
            self.lru.move_to_end(key)
        try:
            os.utime(path)  # a load is a use: other writers and later starts order by it
        except OSError:  # a read-only store: the order is the writes'
            pass
        return data

    def write(self, key: str, payload: bytes) -> None:
        self._make_room(len(payload))
        # A reader sees the whole file or none: written aside, then renamed over (atomic on POSIX).
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, self._file(key, self.context.tp_rank))
        except BaseException:
            os.unlink(tmp)
            raise
        self.written.add(key)
        self.stored_bytes += len(payload) - self.lru.pop(key, 0)
        self.lru[key] = len(payload)

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "evicted_blocks": self.evicted, "stored_bytes": self.stored_bytes}

    def close(self) -> None:
        if self.options.delete_on_close:
            for key in self.written:
                self._file(key, self.context.tp_rank).unlink(missing_ok=True)
            for d in (self.dir, self.root):
                if d.is_dir() and not any(d.iterdir()):
                    shutil.rmtree(d, ignore_errors=True)
