"""Data parallelism: engine replicas behind one server (modserve/server/replicas.py).

The router alone (no model); a ReplicaSet of two tiny engines in-process (conftest's KV-leak
guard checks them); then real `modserve serve` processes driven by the openai client: two
replicas with prefix routing (set in a YAML file), two with load routing (set by flags), held to
one offline engine with the servers' settings in the test process (a one-engine server gives the
same greedy tokens and costs a start). Greedy outputs equal one engine's; a shared-prefix
workload's prefix-cache hits on the second pass equal one engine's with prefix routing and are
far fewer with load routing; /metrics has every metric summed and per replica.

``python tests/test_data_parallel.py MODEL`` measures the prefix hit rate of both routings
on a shuffled shared-prefix workload (docs/parallelism.md, data parallelism).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_process import Server, launch, stop, stop_all, wait_for, wait_healthy

from modserve import LLM
from modserve.core.config import EngineConfig
from modserve.engine.engine import LLMEngine
from modserve.core.sampling_params import SamplingParams
from modserve.server.async_engine import EngineDead
from modserve.api import block_keys
from modserve.server.rank_configs import replica_config
from modserve.server.replicas import ReplicaSet, Router, SplitStream, build_engines

MODEL = "tiny-dp"
BLOCK = 16
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
IN_FLIGHT_TOKENS = 900  # with a 72-token prompt, near the servers' --max-model-len 1024


# -- the router, alone ------------------------------------------------------------------------------
def test_block_keys_chain_the_prefix():
    a = list(range(40))
    b = list(range(32)) + [999] * 8
    ha, hb = block_keys(a, 16), block_keys(b, 16)
    assert len(ha) == 2 and ha == hb  # the third block is not full: not hashed
    c = [7] + list(range(1, 40))
    assert block_keys(c, 16)[0] != ha[0] and block_keys(c, 16)[1] != ha[1]  # a block's hash covers its parents
    assert block_keys(list(range(15)), 16) == []


def test_router_prefix_then_load():
    p0, p1 = [1] * 48, [2] * 48
    router = Router(BLOCK, [100, 100], "prefix", balance_slack=8)
    assert router.choose(p0 + [5], {0: 0, 1: 0}).replica == 0  # no match, a tie: the lowest index
    assert router.choose(p1 + [5], {0: 1, 1: 0}).replica == 1  # no match: the least loaded
    route = router.choose(p0 + [6], {0: 3, 1: 0})  # busier, but it holds the prefix
    assert (route.replica, route.by, route.matched_blocks) == (0, "prefix", 3)
    route = router.choose(p0[:32] + [9] * 16, {0: 0, 1: 0})
    assert (route.replica, route.matched_blocks) == (0, 2)  # the longest match counts the leading blocks
    # a match on both: the longest wins, ties go to the least loaded
    router.choose(p0 + [1] * 16, {0: 5, 1: 0})  # 4 blocks on replica 0 (by prefix)
    router.indexes[1].add(block_keys(p0, BLOCK))
    assert router.choose(p0 + [1] * 16, {0: 5, 1: 0}).replica == 0  # 4 blocks beat 3
    assert router.choose(p0, {0: 5, 1: 0}).replica == 1  # 3 and 3: the less loaded
    # a full batch busier than the idlest: load wins over the prefix
    route = router.choose(p1 + [7], {0: 0, 1: 8})
    assert (route.replica, route.by) == (0, "load")
    assert router.stats()["routed"][1]["prefix"] == 1 and router.prompt_blocks > router.matched_blocks > 0


def test_router_keeps_lora_adapters_prefixes_apart():
    """Prefix routing keys a prompt's blocks as the engines do, salted by its adapter: the same
    prompt under another adapter matches nothing there, and under the same adapter it does."""
    from modserve.core.lora_request import LoRARequest

    prompt, adapter = [3] * 48 + [5], LoRARequest("sql", 1, "/adapters/sql").cache_salt
    router = Router(BLOCK, [100, 100], "prefix")
    assert router.choose(prompt, {0: 0, 1: 0}, adapter).replica == 0
    base = router.choose(prompt, {0: 1, 1: 0})  # the base model's KV of it is nowhere yet
    assert (base.replica, base.by, base.matched_blocks) == (1, "load", 0)
    again = router.choose(prompt, {0: 2, 1: 1}, adapter)
    assert (again.replica, again.by, again.matched_blocks) == (0, "prefix", 3)


def test_router_load_ignores_prefixes_and_skips_dead_replicas():
    router = Router(BLOCK, [100, 100, 100], "load")
    p = [3] * 32
    assert router.choose(p, {0: 0, 1: 0, 2: 0}).replica == 0
    assert router.choose(p, {0: 1, 1: 0, 2: 0}).replica == 1
    assert router.choose(p, {0: 1, 2: 1}).replica == 0  # replica 1 is down: not in loads
    prefix = Router(BLOCK, [100, 100, 100], "prefix")
    prefix.choose(p, {0: 0, 1: 0, 2: 0})
    assert prefix.choose(p, {1: 0, 2: 0}).replica == 1  # the holder is down: the least loaded live one


def test_router_index_is_a_bounded_lru():
    router = Router(BLOCK, [4, 4], "prefix")
    old, new = [1] * 32, [2] * 48
    router.choose(old, {0: 0, 1: 0})
    router.choose(new, {0: 0, 1: 1})  # 3 more blocks on replica 0: the oldest of `old` goes
    assert len(router.indexes[0]) == 4
    assert router.choose(old, {0: 0, 1: 0}).matched_blocks == 0  # its first block was evicted
    with pytest.raises(ValueError, match="data_parallel_routing"):
        Router(BLOCK, [4], "random")  # type: ignore[arg-type]


def test_replica_configs(llama_dir):
    base = EngineConfig(model=llama_dir, data_parallel_size=2, kv_cache_memory_fraction=0.3, seed=5)
    r1 = replica_config(base, 1)
    assert (r1.kv_cache_memory_fraction, r1.seed, r1.device) == (0.15, 6, "cpu")
    sized = replica_config(base.model_copy(update={"num_kv_blocks": 64}), 1)
    assert sized.num_kv_blocks == 64 and sized.kv_cache_memory_fraction == 0.3  # already per engine
    assert replica_config(base.model_copy(update={"device": "cuda"}), 1).device == "cuda:1"
    assert base.data_parallel_routing == "prefix"
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(model=llama_dir, data_parallel_size=0)


# -- a ReplicaSet in-process ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(llama_dir) -> list[LLMEngine]:
    config = EngineConfig(model=llama_dir, num_kv_blocks=64, max_model_len=256, num_threads=1,
                          data_parallel_size=2)
    return build_engines(config, lambda c: LLMEngine(c, progress=False))


def run(engines: list[LLMEngine], body, routing: str = "prefix") -> None:
    async def main() -> None:
        rs = ReplicaSet(engines, routing=routing)  # type: ignore[arg-type]
        rs.start()
        try:
            await asyncio.wait_for(body(rs), 60)
        finally:
            rs.stop()
            assert not rs.alive

    asyncio.run(main())


def test_split_request_equals_one_engine(engines):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, i] for i in range(4)]
    expected = {}
    for i, p in enumerate(prompts):  # replica 0 alone, by hand
        engines[0].add_request(f"solo-{i}", p, params)
    while engines[0].has_unfinished_requests():
        for out in engines[0].step():
            if out.finished:
                expected[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids

    async def body(rs: ReplicaSet) -> None:
        before = await rs.stats()
        stream = rs.submit(prompts, params)
        assert isinstance(stream, SplitStream)  # load spreads them: 2 and 2
        assert [rid.split("-")[1] for rid in stream.request_ids] == ["r0", "r1", "r0", "r1"]
        last = {}
        async for out in stream:
            last[stream.index(out.request_id)] = out
        assert {i: o.outputs[0].token_ids for i, o in last.items()} == expected
        stats = await rs.stats()
        per = [s["prompt_tokens"] - b["prompt_tokens"] for s, b in zip(stats["replicas"], before["replicas"])]
        assert per == [8, 8] and stats["prompt_tokens"] - before["prompt_tokens"] == 16
        assert stats["kv_blocks_total"] == 128 and stats["kv_usage"] == 0.0

    run(engines, body)


def test_close_aborts_every_part_and_one_dead_replica_is_unhealthy(engines):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def body(rs: ReplicaSet) -> None:
        stream = rs.submit([[1, 2, 3], [4, 5, 6]], params)
        assert rs.num_in_flight == 2
        await stream.__anext__()
        stream.close()
        assert rs.num_in_flight == 0
        rs.abort("req-r1-0-0")  # unknown by now: nothing happens
        rs.replicas[1].stop()
        assert not rs.alive and rs.replicas[0].alive
        single = rs.submit([[1] * 40, [2] * 40], SamplingParams(max_tokens=2))  # only replica 0 takes them
        assert not isinstance(single, SplitStream)
        assert [o async for o in single][-1].finished
        rs.replicas[0].stop()
        with pytest.raises(EngineDead):
            rs.submit([[1, 2]], params)
        for _ in range(100):  # the engine threads abort what they held as they stop
            if not any(e.requests for e in engines):
                break
            await asyncio.sleep(0.01)

    run(engines, body)


# -- real servers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_engine(llama_dir):
    """The reference: one offline engine with each server engine's settings (flags below)."""
    with LLM(llama_dir, num_kv_blocks=512, num_threads=1, max_model_len=1024, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def servers(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    common = ["--model", llama_dir, "--served-model-name", MODEL, "--num-kv-blocks", "512", "--num-threads", "1",
              "--max-model-len", "1024"]
    config = tmp / "dp.yaml"
    config.write_text("data_parallel_size: 2\n")
    procs = {"prefix": launch(tmp, "prefix", "--config", str(config), *common),
             "load": launch(tmp, "load", *common, "--data-parallel-size", "2", "--data-parallel-routing", "load")}
    try:
        for s in procs.values():
            wait_healthy(s, timeout=180)
        yield procs
    finally:
        stop_all(*procs.values())


def test_two_replicas_behind_one_server(servers):
    for name in ("prefix", "load"):
        log = servers[name].log.read_text()
        assert "data parallel: 2 engine replicas" in log and f"{name} routing" in log, log
        m = servers[name].metrics()
        assert m["modserve_replica_alive{replica=0}"] == m["modserve_replica_alive{replica=1}"] == 1
        assert m["modserve_kv_blocks_total"] == 1024  # 512 each


def greedy_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(5, 40))] for _ in range(6)]


CHAT = [{"role": "user", "content": "hello there"}]


def one_engine_outputs(llm: LLM, prompts: list[list[int]]) -> list[str]:
    """What ``outputs`` below reads from a server, from the offline engine: batch, streamed (the
    same text), then the chat's two choices."""
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    chat = llm.chat(CHAT, SamplingParams(n=2, temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True),
                    use_tqdm=False)
    return texts + texts + [c.text for c in chat[0].outputs]


def test_greedy_outputs_equal_one_engine(servers, one_engine):
    prompts = greedy_prompts()

    def outputs(server: Server) -> list[str]:
        client = server.client()
        batch = client.completions.create(model=MODEL, prompt=prompts, **GREEDY)  # split over the replicas
        texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
        streamed = [""] * len(prompts)
        for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True, **GREEDY):
            for c in chunk.choices:
                streamed[c.index] += c.text
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, **GREEDY)
        return texts + streamed + [c.message.content for c in chat.choices]

    expected = one_engine_outputs(one_engine, prompts)
    for name in ("prefix", "load"):
        before = servers[name].metrics()
        assert outputs(servers[name]) == expected, name
        after = servers[name].metrics()
        for r in (0, 1):  # both replicas ran some of them
            key = f"modserve_replica_prompt_tokens_total{{replica={r}}}"
            assert after[key] > before[key], (name, r)


def shared_prefix_requests(rng: random.Random, num_prefixes: int, per_prefix: int, prefix_tokens: int,
                           suffix_tokens: int) -> list[tuple[int, list[int]]]:
    """(prefix index, prompt) pairs: ``per_prefix`` prompts for each prefix, distinct suffixes."""
    prefixes = [[rng.randrange(10, 4000) for _ in range(prefix_tokens)] for _ in range(num_prefixes)]
    return [(k, prefixes[k] + [rng.randrange(10, 4000) for _ in range(suffix_tokens)])
            for _ in range(per_prefix) for k in range(num_prefixes)]


def run_in_flight(server: Server, prompts: list[list[int]]) -> None:
    """Open one stream per prompt, in order, each read to its first piece of text (its prompt
    is computed, its blocks are in the prefix cache) before the next is sent, so every routing
    decision sees the ones before it in flight; then close them all and wait until the server
    has none in flight. ``IN_FLIGHT_TOKENS`` is far more than a request can make while the
    others are sent: the load router's counts must not change because one ended early."""
    client = server.client()
    streams = []
    try:
        for p in prompts:
            stream = client.completions.create(model=MODEL, prompt=p, stream=True, temperature=0.0,
                                               max_tokens=IN_FLIGHT_TOKENS, extra_body={"ignore_eos": True})
            streams.append(stream)
            next(iter(stream))
        assert server.load() == len(prompts)  # none ended while the others were sent
    finally:
        for stream in streams:
            stream.close()  # the server aborts a request whose client went away
    wait_for(lambda: server.load() == 0)


_request_ids = itertools.count()


def in_flight_hits(llm: LLM, prompts: list[list[int]]) -> int:
    """``run_in_flight`` on the offline engine: each request stepped to its first token before
    the next is added, then all aborted; the prefix-cache hit tokens that counted."""
    engine = llm.engine
    start = engine.stats()["allocator_prefix_hit_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=IN_FLIGHT_TOKENS, ignore_eos=True)
    rids = []
    for p in prompts:
        rids.append(f"in-flight-{next(_request_ids)}")
        engine.add_request(rids[-1], p, params)
        while not any(o.request_id == rids[-1] and o.outputs[0].token_ids for o in engine.step()):
            pass
    for rid in rids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    return engine.stats()["allocator_prefix_hit_tokens"] - start


def test_prefix_routing_keeps_each_prefix_on_one_replica(servers, one_engine):
    """4 prefixes of 4 blocks, 2 prompts each, all in flight at once; then 8 new prompts on the
    same prefixes, in another order. Each prompt after a prefix's first should find it cached:
    one engine does; prefix routing sends it to the replica that has it; load routing (fewest
    in flight, alternating here) sends it wherever: in the second pass the first four go to
    the replica that does not have their prefix."""
    rng = random.Random(1)
    first = shared_prefix_requests(rng, 4, 2, 4 * BLOCK, 8)
    second = shared_prefix_requests(random.Random(1), 4, 4, 4 * BLOCK, 8)[8:]  # same prefixes, new suffixes
    order = [1, 0, 3, 2, 5, 4, 7, 6]
    hits: dict[str, list[float]] = {}
    key = "modserve_prefix_cache_hit_tokens_total"
    hits["single"] = [in_flight_hits(one_engine, [p for _, p in first]),
                      in_flight_hits(one_engine, [second[i][1] for i in order])]
    for name, server in servers.items():
        start = server.metrics()
        run_in_flight(server, [p for _, p in first])
        middle = server.metrics()
        run_in_flight(server, [second[i][1] for i in order])
        end = server.metrics()
        hits[name] = [middle[key] - start[key], end[key] - middle[key]]
        routed = "modserve_replica_routed_requests_total{{by={},replica={}}}"
        by = {b: sum(end[routed.format(b, r)] - middle[routed.format(b, r)] for r in (0, 1))
              for b in ("prefix", "load")}
        assert by == ({"prefix": 8, "load": 0} if name == "prefix" else {"prefix": 0, "load": 8}), (name, by)
    prefix_tokens = 4 * BLOCK
    # first pass: each prefix's second prompt hits; second pass: all eight do
    assert hits["single"] == [4 * prefix_tokens, 8 * prefix_tokens], hits
    assert hits["prefix"] == hits["single"], hits
    # load: the first pass alternates replicas and lands each pair together; the second pass's
    # first four land on the replica without their prefix, the last four after them
    assert hits["load"] == [4 * prefix_tokens, 4 * prefix_tokens], hits


def test_metrics_sum_the_replicas(servers):
    for name in ("prefix", "load"):
        m = servers[name].metrics()
        summed = [k for k in m if k.startswith("modserve_replica_") and k.endswith("{replica=0}")]
        assert len(summed) >= 20, summed
        for key in summed:
            base = key.removesuffix("{replica=0}")
            total = "modserve_" + base.removeprefix("modserve_replica_")
            if total in m and not total.endswith("_ratio"):  # alive has no sum, a ratio is not one
                assert m[total] == pytest.approx(m[key] + m[f"{base}{{replica=1}}"]), key
        used = m["modserve_kv_blocks_total"] - m["modserve_kv_blocks_free"]
        assert m["modserve_kv_cache_usage_ratio"] == pytest.approx(used / m["modserve_kv_blocks_total"])
        for key in ("modserve_prefix_cache_hit_tokens_total", "modserve_prompt_tokens_total",
                    "modserve_kv_blocks_free", "modserve_engine_steps_total"):
            assert f"modserve_replica_{key.removeprefix('modserve_')}{{replica=0}}" in m, key
        assert m["modserve_router_prompt_blocks_total"] >= m["modserve_router_matched_blocks_total"] > 0


def test_every_block_is_free_and_shutdown_is_clean(servers):
    for name, s in servers.items():
        wait_for(lambda: s.metrics()["modserve_kv_blocks_used"] == 0)
        assert s.metrics()["modserve_num_requests_running"] == 0
    codes = stop_all(*servers.values())  # their shutdowns overlap
    assert all(code in (0, -signal.SIGTERM) for code in codes), codes
    for s in servers.values():
        log = s.log.read_text()
        assert "engine stopped" in log and "Traceback" not in log, log


# -- the measurement behind the docs' figures ------------------------------------------------------
def measure(model: str, out_dir: Path, num_prefixes: int = 16, per_prefix: int = 4, prefix_blocks: int = 16,
            suffix_tokens: int = 32, max_tokens: int = 16, concurrency: int = 8, num_kv_blocks: int = 1024,
            threads: int = 1, extra: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """The prefix-cache hit rate (hit / queried prompt tokens) of one engine and of two replicas
    with each routing, on ``num_prefixes`` x ``per_prefix`` prompts in a shuffled order,
    ``concurrency`` requests in flight at a time."""
    rng = random.Random(0)
    work = shared_prefix_requests(rng, num_prefixes, per_prefix, prefix_blocks * BLOCK, suffix_tokens)
    rng.shuffle(work)
    common = ["--model", model, "--served-model-name", MODEL, "--num-kv-blocks", str(num_kv_blocks),
              "--num-threads", str(threads), "--compile", "off", *extra]
    runs = {"one engine": [], "2 replicas, prefix": ["-dp", "2", "--data-parallel-routing", "prefix"],
            "2 replicas, load": ["-dp", "2", "--data-parallel-routing", "load"]}
    results = {}
    for label, flags in runs.items():
        server = launch(out_dir, label.replace(" ", "_").replace(",", ""), *common, *flags)
        try:
            wait_healthy(server, timeout=600)
            client = server.client()
            before = server.metrics()
            start = time.perf_counter()

            def one(item: tuple[int, list[int]]) -> None:
                client.completions.create(model=MODEL, prompt=item[1], temperature=0.0, max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True})

            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(one, work))
            seconds = time.perf_counter() - start
            after = server.metrics()
        finally:
            stop(server)
        delta = {k: after[k] - before.get(k, 0) for k in after}
        results[label] = {"hit_rate": delta["modserve_prefix_cache_hit_tokens_total"]
                          / delta["modserve_prefix_cache_queried_tokens_total"],
                          "evictions": delta["modserve_prefix_cache_evictions_total"],
                          "seconds": seconds, "requests": len(work)}
        print(label, results[label], flush=True)
    return results


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description="prefix hit rate: one engine, 2 replicas by prefix, by load")
    parser.add_argument("model")
    parser.add_argument("--num-kv-blocks", type=int, default=1024, help="per engine")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--per-prefix", type=int, default=4)
    parser.add_argument("--prefix-blocks", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", default="1024")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(args.model, Path(tmp), args.prefixes, args.per_prefix, args.prefix_blocks,
                                 max_tokens=args.max_tokens, concurrency=args.concurrency,
                                 num_kv_blocks=args.num_kv_blocks, extra=("--max-model-len", args.max_model_len)),
                         indent=2))
