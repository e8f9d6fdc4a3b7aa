"""``kv_connector: shared_storage``: every prompt block's KV in a file under a directory.

Files are ``PATH/NAMESPACE/rank{r}/{key}.kv`` (the namespace names the checkpoint, the
cache layout and the tensor-parallel size; the key is the block's hash chain), each a
CRC32 and the block's bytes. Engines that share the directory share prefills: a producer
writes what a consumer loads, as vLLM's SharedStorageConnector does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import KVConnectorContext
from modserve.plugins.kv_connectors.block_store import BlockStore


class SharedStorageOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field("kv_store", description="Directory the blocks are written to and read from "
                      "(vLLM's shared_storage_path)")
    delete_on_close: bool = Field(False, description="Remove the blocks this engine wrote when it stops")


class SharedStorageConnector(BlockStore):
    def __init__(self, context: KVConnectorContext, options: SharedStorageOptions | None = None) -> None:
        super().__init__(context, options or SharedStorageOptions())
        self.root = Path(self.options.path).expanduser() / context.namespace
        self.dir = self.root / f"rank{context.tp_rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.written: set[str] = set()

    def _file(self, key: str, rank: int) -> Path:
        return self.root / f"rank{rank}" / f"{key}.kv"

    def has(self, key: str, rank: int) -> bool:
        return self._file(key, rank).is_file()

    def read(self, key: str) -> bytes | None:
        try:
            return self._file(key, self.context.tp_rank).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, payload: bytes) -> None:
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

    def close(self) -> None:
        if self.options.delete_on_close:
            for key in self.written:
                self._file(key, self.context.tp_rank).unlink(missing_ok=True)
            for d in (self.dir, self.root):
                if d.is_dir() and not any(d.iterdir()):
                    shutil.rmtree(d, ignore_errors=True)
