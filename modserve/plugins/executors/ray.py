"""ray: one Ray actor per tensor-parallel rank beyond the engine's own, placed by a placement group.

As vLLM's Ray executor: ``ray.init(address, ignore_reinit_error=True)`` (no address: a local
cluster of this machine, which this executor also stops and which dies with this process,
ray_cluster.py); a placement group of one bundle per rank (``{"CPU": 1}``, or ``{"GPU": 1}`` on
CUDA), strategy ``PACK``, bundle 0 held on the driver's node, since rank 0 is the engine's own
process (in a data-parallel core's actor, the group that actor runs in, server/ray_cores.py);
rank ``r`` > 0 is an actor on bundle
``r`` whose one call runs :func:`modserve.api.run_worker` until rank 0 stops it. The ranks meet
at the driver's node IP. Ray is optional: ``pip install modserve[ray]``.

Bundle 0 is pinned by the node-id label (``ray.io/node-id``) rather than vLLM's ``node:<ip>``
resource: several Ray nodes may share one IP (``ray.cluster_utils.Cluster``, containers), and
then the IP names none of them in particular.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from modserve.api import Executor, WorkerSpec, run_worker

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it (ray.util.placement_group.NODE_ID_LABEL_KEY)


class RayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = Field(
        None, description="Ray cluster to join (host:port, auto, ray://...); default: the Ray this process is "
        "already connected to, else RAY_ADDRESS, else a new local cluster of this machine, stopped at shutdown")
    num_cpus: int | None = Field(
        None, gt=0, description="CPUs of the local cluster this executor starts (default: one per rank, or "
        "Ray's count on CUDA)")
    placement_timeout: float = Field(
        60.0, gt=0, description="Seconds to wait for the placement group's bundles (one per rank) to be placed")
    stop_timeout: float = Field(10.0, gt=0, description="Seconds a worker may take to stop before it is killed")


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("the ray executor needs Ray, an optional dependency: pip install modserve[ray]") from e
    return ray


class RankActor:
    """The process of one rank > 0 (made a Ray actor class by :meth:`RayExecutor.start`)."""

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "actor_id": ctx.get_actor_id(), "pid": os.getpid()}

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)  # blocks until rank 0 broadcasts stop


class RayExecutor(Executor):
    def __init__(self, options: RayOptions | None = None) -> None:
        super().__init__(options or RayOptions())
        self.ray = _import_ray()
        self.started_cluster = False  # this executor started the cluster: stop it at shutdown
        self.cluster: Any = None  # its LocalCluster (ray_cluster.py)
        self.owns_pg = True  # False: the placement group of a data-parallel core (server/ray_cores.py)
        self.driver_node_id: str | None = None
        self.pg = None
        self.actors: list[Any] = []  # rank r at index r - 1
        self.runs: list[Any] = []  # ObjectRef of each actor's run(spec): ready once the rank is gone
        self.wheres: list[Any] = []  # ObjectRef of each actor's where()
        self.bundle_nodes: dict[int, str] = {}  # bundle (= rank) -> Ray node id
        self.why: str | None = None

    # -- the cluster ------------------------------------------------------------
    def _address(self) -> str | None:
        return self.options.address or os.environ.get("RAY_ADDRESS") or None

    def _local(self) -> bool:
        """No address and no Ray yet in this process: this executor starts a local cluster."""
        return self._address() is None and not self.ray.is_initialized()

    def _connect(self, world: int | None = None, cuda: bool = False) -> None:
        ray = self.ray
        if not ray.is_initialized():
            if self._address() is None:
                from modserve.plugins.executors.ray_cluster import LocalCluster

                num_cpus = self.options.num_cpus or (None if cuda else world)
                # a new cluster, never one found in /tmp/ray/ray_current_cluster, that dies with this process
                self.cluster = LocalCluster(num_cpus)
                ray.init(address=self.cluster.address)
                self.started_cluster = True
            else:
                ray.init(address=self._address(), ignore_reinit_error=True)
        self.driver_node_id = ray.get_runtime_context().get_node_id()

    def rendezvous_host(self) -> str:
        if self._local():
            # The cluster starts in start() (it is sized by the ranks); its one node is this machine
            # and takes this same address (Ray's node IP of this machine).
            return self.ray.util.get_node_ip_address()
        self._connect()
        return self.ray.util.get_node_ip_address()  # the driver's node's, as Ray knows it

    # -- the ranks --------------------------------------------------------------
    def start(self, workers: list[WorkerSpec]) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = workers[0].world_size
        device = str(workers[0].config.get("device", "cpu"))
        cuda = device.startswith("cuda")
        self._connect(world, cuda)
        try:
            unit = {"GPU": 1.0} if cuda else {"CPU": 1.0}
            current = ray.util.get_current_placement_group()
            if current is not None and len(current.bundle_specs) >= world:
                # rank 0 is a data-parallel core's actor on bundle 0 of its rank's group: the ranks take the rest
                self.pg, self.owns_pg = current, False
            else:
                # Bundle 0 is rank 0's (the driver's) share: held on the driver's node, never used by an actor.
                self.pg = placement_group([dict(unit) for _ in range(world)], strategy="PACK", name="modserve-tp",
                                          bundle_label_selector=[{NODE_ID_LABEL: self.driver_node_id}]
                                          + [{} for _ in range(world - 1)])
            if not self.pg.wait(self.options.placement_timeout):
                raise RuntimeError(
                    f"ray executor: the cluster could not place {world} bundles of {unit} (one per rank, the "
                    f"first on the driver's node) in {self.options.placement_timeout:g} s; available: "
                    f"{ray.available_resources()}, nodes: {self._node_ips()}")
            self.bundle_nodes = dict(placement_group_table(self.pg)["bundles_to_node_id"])
            actor_cls = ray.remote(RankActor)
            for spec in workers:
                spec = self._spec_for(spec, cuda)
                options: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1} if cuda else {"num_cpus": 1}
                env = dict(spec.env)
                if cuda:
                    # rank r uses cuda:<its index on its node>, as mp's cuda:<rank> on one machine;
                    # Ray narrowing CUDA_VISIBLE_DEVICES would make that index name another device.
                    env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
                actor = actor_cls.options(
                    max_restarts=0, runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=spec.rank),
                    **options).remote()
                self.actors.append(actor)
                self.wheres.append(actor.where.remote())  # an actor runs its calls in order: where() first
                self.runs.append(actor.run.remote(spec))
        except BaseException:
            self.shutdown()
            raise

    def _spec_for(self, spec: WorkerSpec, cuda: bool) -> WorkerSpec:
        """On CUDA without a device index: the rank's index among the ranks on its node (rank 0,
        the driver, has index 0 on its node); the driver's CUDA_VISIBLE_DEVICES only on its node."""
        device = str(spec.config.get("device", "cpu"))
        if not cuda or ":" in device:
            return spec
        node = self.bundle_nodes[spec.rank]
        local = sum(1 for r in range(spec.rank) if self.bundle_nodes.get(r) == node)
        env = dict(spec.env)
        if node != self.driver_node_id:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        return WorkerSpec({**spec.config, "device": f"cuda:{local}"}, spec.rank, spec.world_size,
                          spec.init_method, spec.backend, spec.plugins, env)

    def _node_ips(self) -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}

    def placement(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Where each rank > 0 runs: ``{rank, node_id, actor_id, pid}`` as its actor reports it."""
        return [{"rank": r, **where} for r, where in enumerate(self.ray.get(self.wheres, timeout=timeout), 1)]

    def _describe(self, rank: int) -> str:
        actor = self.actors[rank - 1]
        actor_id = getattr(getattr(actor, "_actor_id", None), "hex", lambda: "?")()
        node = self.bundle_nodes.get(rank, "?")
        ip = self._node_ips().get(node, "a node no longer alive")
        return f"rank {rank} (Ray actor {actor_id} on node {node} at {ip})"

    def failed(self) -> str | None:
        if self.why is not None or not self.runs:
            return self.why
        ray = self.ray
        if not ray.is_initialized():  # ray.shutdown() by someone else: this driver's actors went with it
            self.why = f"Ray was shut down in this process: its {len(self.runs)} rank actor(s) are gone"
            return self.why
        ready, _ = ray.wait(self.runs, num_returns=1, timeout=0, fetch_local=False)
        if not ready:
            return None
        rank = self.runs.index(ready[0]) + 1
        try:
            ray.get(ready[0], timeout=10)
            what = "ended (its run_worker returned)"
        except ray.exceptions.RayActorError as e:  # the process is gone: killed, crashed, its node lost
            what = f"died: {_first_lines(e)}"
        except ray.exceptions.RayTaskError as e:  # run_worker raised
            cause = getattr(e, "cause", None) or e
            what = f"failed: {type(cause).__name__}: {_first_lines(cause)}"
        except Exception as e:  # noqa: BLE001 - whatever Ray says is the reason
            what = f"is gone: {type(e).__name__}: {_first_lines(e)}"
        self.why = f"{self._describe(rank)} {what}"
        return self.why

    def shutdown(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            self.actors, self.runs, self.wheres, self.pg = [], [], [], None
            self._stop_cluster()
            return
        from ray.util.placement_group import remove_placement_group

        if self.runs:  # rank 0 already broadcast stop: give the workers a moment to return
            ray.wait(self.runs, num_returns=len(self.runs), timeout=self.options.stop_timeout, fetch_local=False)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.runs:  # a killed actor's call ends with RayActorError once its process is gone
            ray.wait(self.runs, num_returns=len(self.runs), timeout=self.options.stop_timeout, fetch_local=False)
        if self.pg is not None and self.owns_pg:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.actors, self.runs, self.wheres, self.pg = [], [], [], None
        self._stop_cluster()

    def _stop_cluster(self) -> None:
        if self.started_cluster:
            self.ray.shutdown()
            self.started_cluster = False
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def _first_lines(e: BaseException, n: int = 6) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:n]) or type(e).__name__
