"""Data parallelism: N engine replicas behind one server, each request routed to one of them.

:class:`ReplicaSet` is an :class:`~modserve.engine.client.EngineClient`, as an
:class:`AsyncEngine` is, over N AsyncEngines, each stepping its own :class:`LLMEngine`
(which may itself be tensor-parallel) in its own thread.

Routing (:class:`Router`, on the event loop): a prompt's full KV blocks are hashed by
``block_keys``, the prefix cache's keys (a block's hash covers every token before it), and every replica keeps an LRU set of the hashes of the prompts sent
to it, about as many as it has KV blocks. With ``prefix`` routing a prompt goes to the
replica holding the longest run of its leading hashes, when that is one block or more and
that replica is not a full batch (``max_num_seqs``) busier than the idlest one; otherwise,
and always with ``load`` routing, to the replica with the fewest requests in flight
(ties: the lowest index). Each prompt of a request is routed alone: one request's
prompts may run on several replicas, and their outputs come back through one stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from modserve.core.config import EngineConfig
from modserve.core.contracts.kv_allocator import block_keys
from modserve.core.lora_request import LoRARequest
from modserve.core.structured_outputs import GrammarSpec
from modserve.engine.client import EngineClient
from modserve.engine.engine import LLMEngine
from modserve.engine.grammar_compile import CompiledGrammar
from modserve.core.sampling_params import SamplingParams
from modserve.server.async_engine import AsyncEngine
from modserve.server.engine_frontend import EngineDead, EngineFrontend, RequestObserver, RequestStream
from modserve.server.rank_configs import replica_config, spreads_over_devices

logger = logging.getLogger("modserve.server")

Routing = Literal["load", "prefix"]
ROUTINGS: tuple[str, ...] = ("load", "prefix")


# -- building the replicas ------------------------------------------------------------------------
def build_engines(config: EngineConfig, make: Callable[[EngineConfig], LLMEngine]) -> list[LLMEngine]:
    """``config.data_parallel_size`` engines, one after the other (each sizes its KV cache on
    what the ones before left free); if one fails, those already built are shut down."""
    n = config.data_parallel_size
    if n == 1:
        return [make(config)]
    if spreads_over_devices(config):
        import torch

        have = torch.cuda.device_count()
        if have < n:
            raise ValueError(f"data_parallel_size={n} on device cuda needs {n} devices, this machine has {have}; "
                             "give device cuda:0 to put every replica on one device")
    engines: list[LLMEngine] = []
    try:
        for i in range(n):
            logger.info("data parallel: building replica %d of %d", i + 1, n)
            engines.append(make(replica_config(config, i)))
    except BaseException:
        for engine in engines:
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        raise
    return engines


# -- routing ------------------------------------------------------------------------------------------
class PrefixIndex:
    """The block hashes of the prompts routed to one replica: an LRU set of at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.hashes: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, h: str) -> bool:
        return h in self.hashes

    def __len__(self) -> int:
        return len(self.hashes)

    def add(self, hashes: Sequence[str]) -> None:
        """Record ``hashes`` as the most recent (in order: a prefix's first block is evicted first)."""
        table = self.hashes
        for h in hashes:
            if h in table:
                table.move_to_end(h)
            else:
                table[h] = None
        while len(table) > self.capacity:
            table.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Route:
    replica: int
    by: Literal["prefix", "load"]
    matched_blocks: int  # leading blocks of the prompt the replica's index held


@dataclass
class Router:
    """Picks a replica for each prompt; loop thread only.

    ``capacities``: each replica's index size, about its KV block count. ``balance_slack``:
    a prefix match is given up for the least loaded replica once its replica has this many
    more requests in flight than that one (its queue would cost more than the prefill saved).
    """

    block_size: int
    capacities: Sequence[int]
    routing: Routing = "prefix"
    balance_slack: int = 128
    indexes: list[PrefixIndex] = field(init=False)
    routed: list[dict[str, int]] = field(init=False)  # per replica: prompts routed by prefix, by load
    prompt_blocks: int = 0  # full blocks of every prompt routed
    matched_blocks: int = 0  # of those, held by the index of the replica chosen

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"data_parallel_routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        self.indexes = [PrefixIndex(c) for c in self.capacities]
        self.routed = [{"prefix": 0, "load": 0} for _ in self.capacities]

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int], salt: bytes = b"") -> Route:
        """The replica for a prompt, among ``loads``' keys (the live replicas: their requests in
        flight); the prompt's blocks are then recorded in that replica's index. ``salt``: its LoRA
        adapter's (``LoRARequest.cache_salt``), as the engines key its blocks: no adapter's
        prompt matches another's KV."""
        hashes = block_keys(token_ids, self.block_size, salt=salt)
        least = min(loads, key=lambda i: (loads[i], i))
        route = Route(least, "load", self._matched(least, hashes))
        if self.routing == "prefix" and hashes:
            best, matched = self._longest_match(hashes, loads)
            if matched and loads[best] - loads[least] < self.balance_slack:
                route = Route(best, "prefix", matched)
        self.indexes[route.replica].add(hashes)
        self.routed[route.replica][route.by] += 1
        self.prompt_blocks += len(hashes)
        self.matched_blocks += route.matched_blocks
        return route

    def _longest_match(self, hashes: list[str], loads: Mapping[int, int]) -> tuple[int, int]:
        """(replica, leading blocks matched): the longest run; among equals the least loaded, then
        the lowest index. One pass down the chain, dropping replicas as their run ends."""
        candidates = sorted(loads, key=lambda i: (loads[i], i))
        matched = 0
        for h in hashes:
            still = [i for i in candidates if h in self.indexes[i]]
            if not still:
                break
            candidates, matched = still, matched + 1
        return candidates[0], matched

    def _matched(self, replica: int, hashes: list[str]) -> int:
        index = self.indexes[replica]
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        return {"prompt_blocks": self.prompt_blocks, "matched_blocks": self.matched_blocks,
                "routed": [dict(r) for r in self.routed], "index_blocks": [len(ix) for ix in self.indexes]}


# -- the replica set -------------------------------------------------------------------------------
class ReplicaSet(EngineClient):
    """N AsyncEngines behind the interface of one (see the module's docstring)."""

    def __init__(self, engines: Sequence[LLMEngine | EngineFrontend], observer: RequestObserver | None = None,
                 routing: Routing | None = None, balance_slack: int | None = None) -> None:
        """``engines``: engine-core processes' clients (EngineProcess), or LLMEngines to step in
        threads of this process (each wrapped in an AsyncEngine)."""
        if not engines:
            raise ValueError("a ReplicaSet needs at least one engine")
        # Replica i's request ids read ``req-r<i>-...``: unique across the set, so an abort by
        # id reaches only the replica holding the request.
        self.replicas: list[EngineFrontend] = [e if isinstance(e, EngineFrontend) else
                                               AsyncEngine(e, observer, id_prefix=f"r{i}-")
                                               for i, e in enumerate(engines)]
        self.config = config = self.replicas[0].config
        self.limits = self.replicas[0].limits  # replicas of one config: the same limits
        self.router = Router(config.block_size, [r.num_kv_blocks for r in self.replicas],
                             routing or config.data_parallel_routing,
                             balance_slack if balance_slack is not None else config.max_num_seqs)

    @property
    def observer(self) -> RequestObserver | None:
        return self.replicas[0].observer

    @observer.setter
    def observer(self, observer: RequestObserver | None) -> None:
        for r in self.replicas:
            r.observer = observer

    @property
    def routing(self) -> str:
        return self.router.routing

    def __len__(self) -> int:
        return len(self.replicas)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.stop(timeout)

    def shutdown_engine(self) -> None:
        """Each replica's ``shutdown_engine()`` (its tensor-parallel workers), after ``stop()``;
        one that fails does not keep the others' workers running."""
        for i, r in enumerate(self.replicas):
            try:
                r.shutdown_engine()
            except Exception:
                logger.exception("could not shut down replica %d's engine", i)

    @property
    def alive(self) -> bool:
        """Every replica's thread is running (a server with one down is unhealthy)."""
        return all(r.alive for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """Why the first replica that died did (see AsyncEngine.dead_reason), else None."""
        for i, r in enumerate(self.replicas):
            if r.dead_reason is not None:
                return f"replica {i}: {r.dead_reason}"
        return None

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams, arrival_time: float | None = None,
               priority: int = 0, lora_request: LoRARequest | None = None) -> RequestStream | SplitStream:
        """Each prompt to its replica (see :class:`Router`); one stream for all of them. Only
        live replicas get requests; with none, EngineDead."""
        loads = {i: r.num_in_flight for i, r in enumerate(self.replicas) if r.alive}
        if not loads:
            raise EngineDead("no engine replica is running")
        groups: dict[int, list[int]] = {}
        for pos, token_ids in enumerate(prompts):
            route = self.router.choose(token_ids, loads, b"" if lora_request is None else lora_request.cache_salt)
            loads[route.replica] += 1
            groups.setdefault(route.replica, []).append(pos)
        if len(groups) <= 1:
            replica = next(iter(groups), min(loads))
            return self.replicas[replica].submit(prompts, params, arrival_time, priority, lora_request)
        ids = [""] * len(prompts)
        for replica, positions in groups.items():
            for pos, rid in zip(positions, self.replicas[replica].new_request_ids(len(positions))):
                ids[pos] = rid
        stream = SplitStream(self, ids, self.replicas[0].stall_timeout)
        try:
            for replica, positions in groups.items():
                self.replicas[replica].add(stream, [ids[p] for p in positions], [prompts[p] for p in positions],
                                           params, arrival_time, priority, lora_request)
        except BaseException:
            stream.close()
            raise
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        for r in self.replicas:  # ids are unique across replicas: only the holder acts
            r.abort(request_id, reason)

    def cancel_all(self, error: Exception) -> None:
        for r in self.replicas:
            r.cancel_all(error)

    # NOTE: a request's constraint is checked on replica 0's compiler alone: the replicas share
    # one config, so a spec one refuses every one refuses (each compiles its own again, cached).
    def compile_grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        return self.replicas[0].compile_grammar(spec)

    def stop_compiles(self) -> None:
        self.replicas[0].stop_compiles()

    async def call_utility(self, method: str, *args: Any) -> Any:
        """On the live replica with the fewest requests in flight."""
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineDead("no engine replica is running")
        return await min(live, key=lambda r: r.num_in_flight).call_utility(method, *args)

    async def stats(self) -> dict[str, Any]:
        """The replicas' engine.stats() summed (kv_usage recomputed from the sums), with each
        replica's own (plus ``alive``) under ``replicas`` and the router's under ``routing``."""
        per = await asyncio.gather(*(r.stats() for r in self.replicas))
        replicas = [{**(s or {}), "alive": int(r.alive)} for r, s in zip(self.replicas, per)]
        total = sum_stats(replicas)
        total["replicas"] = replicas
        total["routing"] = self.router.stats()
        return total


def sum_stats(per: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Numeric values summed key by key; ``kv_usage`` is the used share of the summed blocks."""
    total: dict[str, Any] = {}
    for stats in per:
        for key, value in stats.items():
            if key == "stats_age_s":  # how old the oldest replica's figures are
                total[key] = max(total.get(key, 0.0), value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            elif key == "lora":  # the adapters' names, joined over the replicas; max_lora is each one's
                mine = total.setdefault(key, {"max_lora": value["max_lora"], "running": [], "waiting": []})
                for side in ("running", "waiting"):
                    mine[side] = sorted({*mine[side], *value[side]})
            elif key == "expert_tokens":  # {layer: [tokens per expert]}, summed expert by expert
                mine = total.setdefault(key, {})
                for layer, counts in value.items():
                    mine[layer] = [a + b for a, b in zip(mine.get(layer, [0] * len(counts)), counts)]
    if total.get("kv_blocks_total"):
        total["kv_usage"] = 1.0 - total.get("kv_blocks_free", 0) / total["kv_blocks_total"]
    return total


class SplitStream(RequestStream):
    """One request's prompts running on several replicas, read as one RequestStream: each
    replica puts its requests' outputs to it, and it ends them through the ReplicaSet (the
    holder of each id aborts it). An error from any part ends the whole stream and aborts
    the rest, as in any RequestStream."""
