"""``kv_connector: mooncake``: prompt blocks pulled over the network with Mooncake's
transfer engine (TCP transport, peers found by its P2P handshake: no etcd).

The producer (prefill) copies each full prompt block, as its layers are written, into a
pool of host memory registered with its transfer engine, and holds it there for a consumer.
The consumer (decode) asks the producer's side channel (ZMQ) where a prompt's blocks are,
reads them with the transfer engine straight into its own cache blocks, then tells the
producer it is done, which frees them. A block no consumer reads is freed after
``abort_request_timeout`` seconds, so the pool never holds more than its size for longer.

A freed slot is reused: the consumer's "done" names each slot's generation, and the
producer answers which slots were held, untouched, for the whole read; the others fail
their load (recomputed or failed per ``kv_load_failure_policy``), never read as stale KV.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field

from modserve.api import BlockTransfer, KVConnector, KVConnectorContext
from modserve.plugins.kv_connectors import mooncake_channel as channel

# Transfers in one batched read: more at once overflow the TCP transport's queue, and fail.
MAX_BATCH = 1024
MAX_FOUND = 65536  # consumer: block addresses remembered between the scheduler's lookup and the load


class MooncakeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hostname: str = Field("127.0.0.1", description="The address this engine's transfer engine and side channel "
                          "listen on and give to peers (the host's IP for another machine)")
    bootstrap_port: int = Field(8998, ge=0, le=65535, description="Producer: the side channel's port for rank 0, "
                                "rank r takes this + r (vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT); 0: any free port")
    remote_bootstrap_addr: str | None = Field(None, pattern=r"^[^\s:]+:\d+$", description="Consumer: the producer's side channel, "
                                              "host:port of its rank 0, for requests that name none in their "
                                              "kv_transfer_params; role both without it reads its own pool")
    size_gb: float = Field(1.0, gt=0, description="Producer: host memory for the blocks held for consumers (GiB)")
    num_blocks: int | None = Field(None, gt=0, description="Producer: exact pool size in blocks (overrides size_gb)")
    abort_request_timeout: float = Field(480.0, gt=0, description="Producer: seconds a block is held for a consumer "
                                         "that never reads it (vLLM's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)")
    max_remote_producers: int = Field(64, ge=1, description="Consumer: side channels kept open to producers named by "
                                      "requests' kv_transfer_params; past it the least recently used is closed")


@dataclass(slots=True)
class Held:
    slot: int
    generation: int
    deadline: float  # monotonic seconds


class Found(NamedTuple):
    """Consumer: where a producer said a block is, from a lookup until the load reads it."""
    peer: str  # the producer's transfer engine, host:port
    addr: int  # the block's slot in its pool
    generation: int
    chain: tuple[str, ...]  # the prompt's keys, released together
    source: str | None  # the producer's side channel (host:port of rank 0); None: the configured one


def side_channel(remote: dict[str, Any]) -> str:
    """The producer's side channel a request's kv_transfer_params name: ``remote_bootstrap_addr``
    (vLLM's Mooncake spelling, ``http://`` optional) or ``remote_host`` and ``remote_port``;
    "" when they name none (the server checks them: only an engine used offline gets here)."""
    addr = remote.get("remote_bootstrap_addr")
    if addr:
        return str(addr).removeprefix("http://").rstrip("/")
    host, port = remote.get("remote_host"), remote.get("remote_port")
    return f"{host}:{port}" if host and isinstance(port, int) else ""


def _engine(hostname: str):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the wheel, or a library it links (libibverbs), is missing
        raise RuntimeError(f"kv_connector mooncake needs Mooncake's transfer engine: pip install "
                           f"'modserve[mooncake]' (and libibverbs1 on Debian/Ubuntu): {e}") from e
    engine = TransferEngine()
    if engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"kv_connector mooncake: the transfer engine did not start on {hostname}")
    return engine


class MooncakeConnector(KVConnector):
    def __init__(self, context: KVConnectorContext, options: MooncakeOptions | None = None) -> None:
        super().__init__(context, options or MooncakeOptions())
        opts = self.options
        self.produces = context.role in ("producer", "both")
        self.consumes = context.role in ("consumer", "both")
        if context.role == "both" and not opts.remote_bootstrap_addr and context.tp_size > 1 \
                and not opts.bootstrap_port:
            raise ValueError("kv_connector mooncake: role both under tensor parallelism reads its own ranks' pools, "
                             "at bootstrap_port + rank: give bootstrap_port, not 0")
        self.engine = _engine(opts.hostname)
        self.peer = f"{opts.hostname}:{self.engine.get_rpc_port()}"  # this engine's transfer endpoint
        self.lock = threading.Lock()
        self.held: dict[str, Held] = {}  # producer: key -> its slot, until read or expired
        self.generation = 0
        self.found: dict[str, Found] = {}  # consumer: key -> where its producer holds it
        self.producers: OrderedDict[str, list[channel.Client]] = OrderedDict()  # named by requests, per rank
        self.clients: list[channel.Client] = []  # the configured producer's ranks (none: requests name theirs)
        self.counters = {"blocks_read": 0, "bytes_read": 0, "blocks_stale": 0, "blocks_held_freed": 0,
                         "blocks_held_expired": 0, "blocks_not_held": 0}
        self.server: channel.SideChannel | None = None
        self.registered: list[int] = []  # memory the transfer engine may read or write, unregistered at close

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        ctx, opts = self.context, self.options
        cache = kv_caches[ctx.layers[0]]
        # One block of one layer's K (or V): cache[kv, block] is contiguous, [block_size, heads, dim].
        self.chunk = cache[0, 0].numel() * cache.element_size()
        self.block_bytes = 2 * self.chunk * len(ctx.layers)
        if self.consumes:
            for layer in ctx.layers:
                t = kv_caches[layer]
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError("kv_connector mooncake (its non-CUDA build) reads into a contiguous KV cache "
                                     f"in host memory; this one is on {t.device}")
                self._register(t.data_ptr(), t.numel() * t.element_size())
            remote = opts.remote_bootstrap_addr
        if self.produces:
            n = opts.num_blocks or max(1, int(opts.size_gb * 2**30 // self.block_bytes))
            # [slots, L, 2, ...block]: a slot is one block of every layer of this rank, as the consumer reads it.
            self.pool = torch.empty((n, len(ctx.layers), 2, *cache.shape[2:]), dtype=cache.dtype)
            self._register(self.pool.data_ptr(), self.pool.numel() * self.pool.element_size())
            self.free = list(range(n - 1, -1, -1))
            self.saving: dict[str, int] = {}  # this step's saves: key -> slot
            self.last_layer: dict[str, int] = {}  # this step's saves: key -> the last layer copied
            port = opts.bootstrap_port + ctx.tp_rank if opts.bootstrap_port else 0
            self.server = channel.SideChannel(opts.hostname, port, self._answer, self._expire)
            if self.consumes and not opts.remote_bootstrap_addr:
                remote = f"{opts.hostname}:{self.server.port - ctx.tp_rank}"  # role both: its own pool
        if self.consumes and remote:
            self.clients = self._connect(remote)

    def _connect(self, source: str) -> list[channel.Client]:
        """Clients of each rank's side channel of the producer whose rank 0 is at ``source``."""
        host, port = source.rsplit(":", 1)
        return [channel.Client(f"tcp://{host}:{int(port) + r}") for r in range(self.context.tp_size)]

    def _clients(self, source: str | None) -> list[channel.Client]:
        """The configured producer's clients (``source`` None), or those of the one a request
        named, made at its first request and closed once ``max_remote_producers`` newer ones were."""
        if source is None:
            return self.clients
        if not source:  # a request naming no producer finds nothing
            return []
        clients = self.producers.get(source)
        if clients is None:
            try:
                clients = self.producers[source] = self._connect(source)
            except ValueError:  # not host:port
                return []
            while len(self.producers) > self.options.max_remote_producers:
                for client in self.producers.popitem(last=False)[1]:
                    client.close()
        self.producers.move_to_end(source)
        return clients

    def _register(self, ptr: int, length: int) -> None:
        if self.engine.register_memory(ptr, length) != 0:
            raise RuntimeError(f"kv_connector mooncake: could not register {length} bytes with the transfer engine")
        self.registered.append(ptr)

    # -- scheduler side -----------------------------------------------------------------
    def stored_blocks(self, keys: list[str]) -> int:
        if not self.consumes:  # a producer saves only what it does not hold yet
            with self.lock:
                return next((i for i, k in enumerate(keys) if k not in self.held), len(keys))
        return self._lookup(keys, None)

    def stored_blocks_from(self, keys: list[str], remote: dict[str, Any]) -> int:
        if not self.consumes:
            return self.stored_blocks(keys)
        return self._lookup(keys, side_channel(remote))

    def _lookup(self, keys: list[str], source: str | None) -> int:
        clients = self._clients(source)
        if not clients:  # no producer configured, and the request named none
            return 0
        # Every rank's producer is asked: a block counts when all of them hold it.
        replies = [client.ask({"op": "lookup", "keys": keys}) for client in clients]
        if any(r is None for r in replies):  # a producer down or not answering: nothing to load
            return 0
        n = min(len(r["blocks"]) for r in replies)
        self._note(replies[self.context.tp_rank], keys, n, source)
        return n

    def transfer_params(self) -> dict[str, Any] | None:
        """A producer's address for consumers' requests: vLLM's Mooncake spelling
        (``remote_bootstrap_addr``) and NIXL's (``remote_host``, ``remote_port``)."""
        if not self.produces or self.server is None:
            return None
        host, port = self.options.hostname, self.server.port - self.context.tp_rank
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.context.namespace,
                "remote_bootstrap_addr": f"{host}:{port}", "remote_host": host, "remote_port": port,
                "tp_size": self.context.tp_size}

    def _note(self, reply: dict, keys: list[str], n: int, source: str | None) -> None:
        """Remember where the first ``n`` of ``keys`` are, for ``load``; the oldest notes of
        prompts never loaded (their prefix was cached here) are dropped past ``MAX_FOUND``."""
        chain = tuple(keys)
        for key, block in zip(keys[:n], reply["blocks"]):
            self.found.pop(key, None)
            if block is not None:
                self.found[key] = Found(reply["peer"], block[0], block[1], chain, source)
        while len(self.found) > MAX_FOUND:
            del self.found[next(iter(self.found))]

    # -- worker side --------------------------------------------------------------------
    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        """Read each block from the producer into its cache block, rank by rank (each rank's
        instance reads its own heads from its own peer)."""
        missing: dict[str | None, list[str]] = {}
        for t in transfers:
            if t.key not in self.found:
                missing.setdefault(side_channel(t.remote) if t.remote else None, []).append(t.key)
        for source, keys in missing.items():  # ranks past 0 never answer the scheduler: they find theirs now
            clients = self._clients(source)
            reply = clients[self.context.tp_rank].ask({"op": "lookup", "keys": keys, "each": True}) if clients else None
            if reply is not None:
                self._note(reply, keys, len(keys), source)
        failed, reads = [], {}
        done: dict[str | None, dict[str, int]] = {}  # per producer: key -> the generation read
        chains: dict[str | None, set[tuple[str, ...]]] = {}
        for i, t in enumerate(transfers):
            entry = self.found.pop(t.key, None)
            if entry is None:
                failed.append(i)
                continue
            reads.setdefault(entry.peer, []).append((i, entry.addr, t.block_id, entry.source))
            done.setdefault(entry.source, {})[t.key] = entry.generation
            chains.setdefault(entry.source, set()).add(entry.chain)
        per_batch = max(1, MAX_BATCH // (2 * len(self.context.layers)))
        for peer, blocks in reads.items():
            for start in range(0, len(blocks), per_batch):
                batch = blocks[start:start + per_batch]
                if self._read(peer, [(addr, block) for _, addr, block, _ in batch]):
                    continue
                for i, addr, block, source in batch:  # block by block, to fail only those that fail
                    if not self._read(peer, [(addr, block)]):
                        failed.append(i)
                        del done[source][transfers[i].key]
        for source, read in done.items():
            # Done: the producer frees the whole of each prompt's chain, and says which slots stayed
            # ours for the whole read (a slot expired and reused meanwhile held another block).
            release = {key for chain in chains[source] for key in chain}
            reply = self._clients(source)[self.context.tp_rank].ask(
                {"op": "done", "read": read, "release": sorted(release)})
            intact = set(reply["intact"]) if reply is not None else set()
            for i, t in enumerate(transfers):
                if t.key in read and t.key not in intact:
                    failed.append(i)
                    self.counters["blocks_stale"] += 1
            for key in release:
                self.found.pop(key, None)
        return sorted(failed)

    def _read(self, peer: str, blocks: list[tuple[int, int]]) -> bool:
        """Read each (remote slot address, cache block id) from ``peer``: one transfer per layer
        and K/V, as the producer's slot is ``[L, 2, ...block]`` and ``cache[kv, block]`` is contiguous."""
        local, remote = [], []
        for addr, block_id in blocks:
            for li, layer in enumerate(self.context.layers):
                cache = self.kv_caches[layer]
                for kv in range(2):
                    local.append(cache[kv, block_id].data_ptr())
                    remote.append(addr + (2 * li + kv) * self.chunk)
        if self.engine.batch_transfer_sync_read(peer, local, remote, [self.chunk] * len(local)) != 0:
            return False
        self.counters["blocks_read"] += len(blocks)
        self.counters["bytes_read"] += len(blocks) * self.block_bytes
        return True

    def save_layer(self, layer: int, kv_cache: torch.Tensor, transfers: list[BlockTransfer]) -> None:
        if not self.produces:
            return
        li = self.context.layers.index(layer)
        for t in transfers:
            slot = self.saving.get(t.key)
            if slot is None:
                slot = self.saving[t.key] = self._take_slot()
            if slot >= 0:
                self.pool[slot, li] = kv_cache[:, t.block_id]
                self.last_layer[t.key] = li

    def finish_saves(self) -> None:
        if not self.produces:
            return
        whole = len(self.context.layers) - 1
        deadline = time.monotonic() + self.options.abort_request_timeout
        with self.lock:
            for key, slot in self.saving.items():
                if slot < 0:
                    self.counters["blocks_not_held"] += 1  # the pool is full of held blocks
                    continue
                if self.last_layer.get(key) != whole:  # a save_layer raised: not whole, not held
                    self.free.append(slot)
                    continue
                old = self.held.pop(key, None)
                if old is not None:
                    self.free.append(old.slot)
                self.generation += 1
                self.held[key] = Held(slot, self.generation, deadline)
        self.saving.clear()
        self.last_layer.clear()

    def _take_slot(self) -> int:
        with self.lock:
            return self.free.pop() if self.free else -1

    # -- producer's side channel (its thread) ---------------------------------------------
    def _answer(self, msg: dict) -> dict:
        base, size = self.pool.data_ptr(), self.block_bytes
        with self.lock:
            if msg["op"] == "lookup":
                blocks = []
                for key in msg["keys"]:  # the leading run held, or with "each" every key (None: not held)
                    held = self.held.get(key)
                    if held is None and not msg.get("each"):
                        break
                    blocks.append(None if held is None else (base + held.slot * size, held.generation))
                return {"peer": self.peer, "blocks": blocks}
            intact = [k for k, gen in msg["read"].items() if k in self.held and self.held[k].generation == gen]
            for key in msg["release"]:
                held = self.held.pop(key, None)
                if held is not None:
                    self.free.append(held.slot)
                    self.counters["blocks_held_freed"] += 1
            return {"intact": intact}

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for key in [k for k, h in self.held.items() if h.deadline <= now]:
                self.free.append(self.held.pop(key).slot)
                self.counters["blocks_held_expired"] += 1

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for client in [*self.clients, *(c for cs in self.producers.values() for c in cs)]:
            client.close()
        self.clients, self.producers = [], OrderedDict()
        if self.engine is not None:
            for ptr in self.registered:
                self.engine.unregister_memory(ptr)
            self.registered.clear()
            self.engine = None  # NOTE: the transfer engine stops its threads when it is deleted

    def stats(self) -> dict[str, float]:
        with self.lock:
            held = len(self.held)
        return {**self.counters, "blocks_held": held}
