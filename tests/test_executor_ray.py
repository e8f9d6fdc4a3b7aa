"""The ray executor: tensor-parallel ranks > 0 as Ray actors in a placement group.

A local cluster the executor starts and stops itself, then one two-node cluster
(``ray.cluster_utils.Cluster``, both nodes on this machine, one CPU each) shared by the rest:
the PACK placement group must spread there, so rank 1 runs on the other node. Each Ray start
costs 5-15 s here.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

import pytest

ray = pytest.importorskip("ray", reason="the ray executor's tests need Ray: pip install modserve[ray]")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from processes import alive, descendants, wait_until  # noqa: E402
from modserve.api import WorkerSpec  # noqa: E402
from modserve.core.config import EngineConfig  # noqa: E402
from modserve.plugins.executors.ray import RayExecutor, RayOptions  # noqa: E402

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(num_threads=1, num_kv_blocks=64, max_model_len=256, progress=False)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[list[int]]:
    """TP=1's greedy tokens, no Ray involved."""
    return tokens(LLM(llama_dir, **ENGINE))


# -- a local cluster of the executor's own (runs first: no Ray in this process yet) -----------
def test_local_cluster_tp2_matches_tp1_and_leaves_no_process(llama_dir, reference, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # else the executor joins that cluster
    if ray.is_initialized():
        ray.shutdown()  # only a connection, from another test: the executor must start its own cluster
    before = set(descendants(os.getpid()))
    llm = LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor) and executor.started_cluster
        [rank1] = executor.placement()
        assert rank1["node_id"] == executor.driver_node_id  # one node: everything on it
        assert executor.bundle_nodes == {0: executor.driver_node_id, 1: executor.driver_node_id}
        assert tokens(llm) == reference
        assert executor.failed() is None
        ray_processes = {pid for pid, cmd in descendants(os.getpid()).items() if pid not in before}
        assert rank1["pid"] in ray_processes  # the actor's process is one of the cluster's
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()  # the cluster it started is stopped
    assert wait_until(lambda: not alive(rank1["pid"])), "the rank-1 actor's process outlived shutdown"
    left = {pid: cmd for pid, cmd in descendants(os.getpid()).items() if pid not in before}
    assert not left, f"processes left behind: {left}"


# -- two Ray nodes on this machine, shared by the tests below -------------------------------
@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def on_cluster(cluster) -> dict:
    return {"name": "ray", "options": {"address": cluster.address, "placement_timeout": 30}}


def test_two_nodes_rank1_on_the_other_node_same_tokens(llama_dir, reference, cluster):
    llm = LLM(llama_dir, tensor_parallel_size=2, distributed_executor_backend=on_cluster(cluster), **ENGINE)
    try:
        executor = llm.engine.executor
        assert not executor.started_cluster
        head = cluster.head_node.node_id
        assert executor.driver_node_id == head  # the driver attaches to the head node
        [rank1] = executor.placement()
        assert rank1["node_id"] != head, "rank 1 should run on the second node (PACK over 1 + 1 CPUs)"
        assert rank1["node_id"] in {n.node_id for n in cluster.worker_nodes}
        assert executor.bundle_nodes[0] == head and executor.bundle_nodes[1] == rank1["node_id"]
        assert tokens(llm) == reference
        pg = executor.pg
    finally:
        llm.engine.shutdown()
    assert ray.is_initialized()  # connected, not started: the cluster is not the executor's to stop
    assert wait_until(lambda: not alive(rank1["pid"])), "the rank-1 actor's process outlived shutdown"
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert wait_until(lambda: ray.available_resources().get("CPU") == 2.0), ray.available_resources()


def worker_spec(llama_dir, host: str, port: int, **config) -> WorkerSpec:
    cfg = EngineConfig(model=llama_dir, num_threads=1, tensor_parallel_size=2, **config).model_dump()
    return WorkerSpec(cfg, 1, 2, f"tcp://{host}:{port}", "gloo", ["modserve"],
                      {"MODSERVE_LOAD_PLUGINS": "modserve"})


def test_failed_names_the_rank_actor_and_node_of_a_killed_worker(llama_dir, cluster):
    executor = RayExecutor(RayOptions(address=cluster.address, placement_timeout=30, stop_timeout=2))
    host = executor.rendezvous_host()
    # No rank 0 listens there: the worker waits to join, alive, until it is killed.
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    executor.start([worker_spec(llama_dir, host, port)])
    try:
        [rank1] = executor.placement()
        assert executor.failed() is None
        os.kill(rank1["pid"], signal.SIGKILL)
        assert wait_until(lambda: executor.failed() is not None), "a killed worker went unnoticed"
        why = executor.failed()
        assert why.startswith(f"rank 1 (Ray actor {rank1['actor_id']} on node {rank1['node_id']} at "), why
        assert " died: " in why, why
    finally:
        executor.shutdown()
    assert wait_until(lambda: ray.available_resources().get("CPU") == 2.0), ray.available_resources()


def test_failed_reports_a_worker_that_raised(llama_dir, cluster):
    executor = RayExecutor(RayOptions(address=cluster.address, placement_timeout=30, stop_timeout=2))
    host = executor.rendezvous_host()
    spec = worker_spec(llama_dir, host, 1)
    spec.config["num_threads"] = -1  # run_worker's EngineConfig(**spec.config) raises, before any join
    executor.start([spec])
    try:
        assert wait_until(lambda: executor.failed() is not None), "a worker that raised went unnoticed"
        why = executor.failed()
        assert why.startswith("rank 1 (Ray actor ") and " failed: ValidationError: " in why, why
    finally:
        executor.shutdown()


def test_placement_that_cannot_happen_fails_start_and_cleans_up(llama_dir, cluster):
    executor = RayExecutor(RayOptions(address=cluster.address, placement_timeout=2))
    host = executor.rendezvous_host()
    specs = [WorkerSpec(worker_spec(llama_dir, host, 1).config, r, 4, f"tcp://{host}:1", "gloo", [], {})
             for r in range(1, 4)]
    with pytest.raises(RuntimeError, match=r"could not place 4 bundles"):
        executor.start(specs)  # 4 ranks, 2 CPUs
    assert executor.pg is None and not executor.actors
    assert wait_until(lambda: ray.available_resources().get("CPU") == 2.0), ray.available_resources()


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pip install modserve\[ray\]"):
        RayExecutor()
