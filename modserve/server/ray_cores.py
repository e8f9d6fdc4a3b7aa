"""``--data-parallel-backend ray``: Ray places each data-parallel engine core on the cluster.

One placement group per rank holds the core and its tensor x pipeline ranks: ``world`` bundles
of ``{"CPU": 1}``, STRICT_PACK (one node) when the core starts its ranks as processes (mp, uni),
PACK when the ray executor makes them actors of the same group (plugins/executors/ray.py takes
the bundles 1.. of the group its rank 0 runs in). The core is an actor on bundle 0 whose one
call runs the engine-core process's own loop (``core_process.run_core``), and it joins this API
server as a ``--headless`` core does (the handshake at ``--data-parallel-address``:
``--data-parallel-rpc-port``, engine/core_handshake.py): from then on it is a remote core
(server/remote_cores.py) with the same routing, heartbeats, step deadline and per-rank metrics.

The cluster: ``RAY_ADDRESS`` if set, else a local one of this machine, sized for the ranks, that
dies with this process (plugins/executors/ray_cluster.py). A core's actor fate-shares with this
process (its owner), and a core also ends itself once its connection to the server drops.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

import msgspec

from modserve.core.config import EngineConfig
from modserve.engine import core_handshake as h
from modserve.engine.core_process import LaunchSpec
from modserve.server.core_launch import CoreLaunch, EngineStartError, end_launches
from modserve.server.remote_cores import await_remote_cores, bind_remote_core, ready_timeout
from modserve.server.rank_configs import replica_config

logger = logging.getLogger("modserve.server")

PLACEMENT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
_active: list[RayRanks] = []  # shutdown_all()'s


class CoreActor:
    """The process of one data-parallel engine core (made a Ray actor class by RayRanks.join)."""

    def run(self, spec_json: bytes, log_level: str) -> int:
        from modserve.engine.core_process import run_core

        spec = msgspec.json.decode(spec_json, type=LaunchSpec)
        os.environ["MODSERVE_LOG_LEVEL"] = log_level  # the core's own processes (its ranks) inherit it
        logging.basicConfig(level=log_level.upper(), force=True,
                            format=f"%(asctime)s %(levelname)s [engine-core {spec.dp_rank}] %(name)s: %(message)s")
        if os.getpgrp() != os.getpid():  # a lost server's watch kills this process group: the core's own
            os.setpgid(0, 0)
        return run_core(spec)


class RayRanks:
    """engine_process.RemoteRanks: every rank an actor of the Ray cluster (``num_local`` 0)."""

    num_local = 0

    def __init__(self, config: EngineConfig, address: str | None, port: int) -> None:
        if config.device.startswith("cuda"):
            raise SystemExit("--data-parallel-backend ray places CPU engine cores; on CUDA, use mp with --headless "
                             "on each machine (docs/parallelism.md)")
        try:
            import ray
        except ImportError as e:
            raise SystemExit("--data-parallel-backend ray needs Ray, an optional dependency: "
                             "pip install modserve[ray]") from e
        self.ray, self.config, self.port = ray, config, port
        self.address = address
        self.cluster: Any = None  # the LocalCluster this server started
        self.connected = False
        self.groups: list[Any] = []
        self.actors: list[Any] = []
        self.runs: list[Any] = []  # each actor's run(): ready once it ended
        _active.append(self)

    def join(self, ranks: range) -> list[CoreLaunch]:
        world = self.config.tensor_parallel_size * self.config.pipeline_parallel_size
        try:
            self._connect(len(ranks) * world)
            nodes = self._place(ranks, world)
            address = self.address or self.ray.util.get_node_ip_address()  # this node's, as Ray knows it
            launches = [bind_remote_core(rank, address) for rank in ranks]
            try:
                self._start_actors(ranks, nodes, f"tcp://{address}:{self.port}")
                await_remote_cores(launches, address, self.port, self.config, ready_timeout(), self.failed)
            except BaseException:
                end_launches(launches)
                raise
        except BaseException:
            self.shutdown()
            raise
        return launches

    def _connect(self, num_cpus: int) -> None:
        if not self.ray.is_initialized():
            if not os.environ.get("RAY_ADDRESS"):
                from modserve.plugins.executors.ray_cluster import LocalCluster

                self.cluster = LocalCluster(num_cpus)
                logger.info("data parallel over Ray: started a local cluster of %d CPUs at %s", num_cpus,
                            self.cluster.address)
            self.ray.init(address=self.cluster.address if self.cluster else None)
            self.connected = True

    def _place(self, ranks: range, world: int) -> dict[int, str]:
        """One placement group per rank, all placed; rank -> its Ray node."""
        from ray.util.placement_group import placement_group, placement_group_table

        executor = self.config.executor_choice().name
        strategy = "PACK" if executor == "ray" else "STRICT_PACK"  # mp/uni ranks are the core's child processes
        self.groups = [placement_group([{"CPU": 1.0}] * world, strategy=strategy, name=f"modserve-dp{rank}")
                       for rank in ranks]
        if not all(g.wait(PLACEMENT_TIMEOUT_S) for g in self.groups):
            raise EngineStartError(
                f"--data-parallel-backend ray: the cluster could not place {len(ranks)} rank(s) of {world} CPU "
                f"bundle(s) each ({strategy}) in {PLACEMENT_TIMEOUT_S:g} s; available: {self.ray.available_resources()}")
        return {rank: placement_group_table(g)["bundles_to_node_id"][0] for rank, g in zip(ranks, self.groups)}

    def _start_actors(self, ranks: range, nodes: dict[int, str], handshake: str) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        per_node = Counter(nodes.values())
        expected = h.fingerprint(self.config)
        actor_cls = self.ray.remote(CoreActor)
        # NOTE: the level goes as an argument, not a runtime_env: an actor with a runtime_env of
        # its own cannot take one of Ray's pre-started workers and waits for a fresh one's imports
        level = logging.getLevelName(logging.getLogger("modserve").getEffectiveLevel())
        for rank, group in zip(ranks, self.groups):
            config = rank_config(self.config, rank, per_node[nodes[rank]])
            spec = LaunchSpec(config.model_dump_json(), rank, inbox="", outbox="", beats="", parent_pid=0,
                              handshake=handshake, fingerprint=expected, ready_timeout=ready_timeout())
            actor = actor_cls.options(
                num_cpus=1, max_restarts=0, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=0)).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(msgspec.json.encode(spec), level))
            logger.info("data parallel over Ray: engine core %d placed on node %s", rank, nodes[rank])

    def failed(self) -> str | None:
        """Why a core's actor ended before it joined (its call raised, or its process died), or None."""
        if not self.runs:
            return None
        ready, _ = self.ray.wait(self.runs, num_returns=1, timeout=0, fetch_local=False)
        if not ready:
            return None
        try:
            code = self.ray.get(ready[0], timeout=10)
            return f"an engine core's Ray actor ended with code {code} before it joined"
        except Exception as e:  # noqa: BLE001 - Ray's reason is the reason
            return f"an engine core's Ray actor failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def shutdown(self) -> None:
        """Kill the actors, remove the placement groups, disconnect, stop a cluster started here."""
        ray = self.ray
        if ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            if self.runs:  # cores told to stop end their call: give them a moment
                ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT_S, fetch_local=False)
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            for group in self.groups:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed
                    pass
            if self.connected:
                ray.shutdown()
        self.actors, self.runs, self.groups, self.connected = [], [], [], False
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self in _active:
            _active.remove(self)


def rank_config(config: EngineConfig, rank: int, ranks_on_node: int) -> EngineConfig:
    """Rank ``rank``'s config: its seed and port (replica_config's), and its node's memory shared
    by the ``ranks_on_node`` ranks Ray put there."""
    node = config.model_copy(update={"data_parallel_size": ranks_on_node})
    c = replica_config(node, 0)
    c.seed = config.seed + rank
    if config.master_port is not None:
        c.master_port = config.master_port + rank
    return c


def shutdown_all() -> None:
    """Every RayRanks of this process (the server's stop, after its engines stopped)."""
    for ranks in list(_active):
        ranks.shutdown()
