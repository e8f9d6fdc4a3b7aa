"""What the connectors that keep whole blocks by key share: gathering a block's layers as
the forward writes them, and checking and scattering a stored block back into the cache."""

from __future__ import annotations

import zlib
from abc import abstractmethod

import torch

from modserve.api import BlockTransfer, KVConnector


class BlockStore(KVConnector):
    """A store of blocks, each this rank's layers as one ``[L, 2, ...block]`` tensor on the
    host, read and written whole by key; subclasses say where they live."""

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        layer = kv_caches[self.context.layers[0]]
        # One block of all this rank's layers: [L, 2, ...block], as the cache holds it.
        self.block_shape = (len(self.context.layers), 2, *layer.shape[2:])
        self.block_dtype = layer.dtype
        self.block_bytes = layer[:, 0].numel() * layer.element_size() * len(self.context.layers)
        self._pending: dict[str, dict[int, torch.Tensor]] = {}  # key -> layer -> [2, ...block], this step
        self.counters = {"bytes_loaded": 0, "bytes_saved": 0, "blocks_corrupt": 0, "blocks_missing": 0}

    # -- where the blocks live ----------------------------------------------------------
    @abstractmethod
    def has(self, key: str, rank: int) -> bool:
        """Whether rank ``rank``'s part of block ``key`` is stored."""

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """This rank's stored bytes of ``key`` (as :meth:`write` got them), None if absent."""

    @abstractmethod
    def write(self, key: str, payload: bytes) -> None:
        """Store this rank's bytes of ``key``, visible whole or not at all."""

    # -- KVConnector --------------------------------------------------------------------
    def stored_blocks(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if not all(self.has(key, rank) for rank in range(self.context.tp_size)):
                return i
        return len(keys)

    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        failed = []
        for i, t in enumerate(transfers):
            block = self._unpack(t.key)
            if block is None:
                failed.append(i)
                continue
            for layer, part in zip(self.context.layers, block):
                self.kv_caches[layer][:, t.block_id] = part.to(self.kv_caches[layer].device)
            self.counters["bytes_loaded"] += self.block_bytes
        return failed

    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        for t in transfers:
            self._pending.setdefault(t.key, {})[layer] = kv_cache[:, t.block_id].to("cpu", copy=True)

    def finish_saves(self) -> None:
        pending, self._pending = self._pending, {}  # taken first: a write that raises leaves none behind
        for key, layers in pending.items():
            if len(layers) < len(self.context.layers):  # a save_layer of this step raised: not whole
                continue
            block = torch.stack([layers[i] for i in self.context.layers]).contiguous()
            data = block.view(torch.uint8).numpy().tobytes()
            self.write(key, zlib.crc32(data).to_bytes(4, "little") + data)
            self.counters["bytes_saved"] += self.block_bytes

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    def _unpack(self, key: str) -> torch.Tensor | None:
        """The block stored under ``key`` as ``[L, 2, ...block]``; None (counted) when it is
        missing, or its size or checksum is not what was written."""
        payload = self.read(key)
        if payload is None:
            self.counters["blocks_missing"] += 1
            return None
        crc, data = payload[:4], payload[4:]
        if len(data) != self.block_bytes or zlib.crc32(data).to_bytes(4, "little") != crc:
            self.counters["blocks_corrupt"] += 1
            return None
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(self.block_dtype).view(self.block_shape)
