"""KV connectors: a producer's prompt blocks loaded by a consumer give one engine's tokens.

The consumer computes at most one block of each prompt (the counters show it), a block
that is missing or corrupt fails its request or is recomputed as the policy says, and
nothing (a file being written, a shared-memory segment) outlives the engines. The host
tier brings back prefixes the device cache evicted.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from pathlib import Path

import pytest

from modserve import LLM, SamplingParams
from modserve.api import BlockTransfer, KVConnector, block_keys
from modserve.core.contracts.scheduler import SchedulerLimits
from modserve.core.sampling_params import SamplingParams as SP
from modserve.core.sequence import Sequence
from modserve.engine.scheduler import SchedulerCore
from modserve.plugins.kv_allocators.paged import PagedAllocator, PagedOptions
from modserve.plugins.schedulers.fcfs import FCFSScheduler
from modserve.server.metrics import EngineStatsCollector
from modserve.server.replicas import Router

BLOCK = 16
LENGTHS = (40, 77, 100, 16, 5)  # full blocks 2, 4, 6, 1, 0; the 16-token prompt loads none (its last token)
ENGINE = dict(dtype="float32", progress=False, num_kv_blocks=64, max_model_len=512, compile="off",
              block_size=BLOCK)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prompts(seed: int = 0, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(n)] for n in lengths]


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def usable_blocks(n: int) -> int:
    return (n - 1) // BLOCK  # whole blocks, never the last token


@pytest.fixture(scope="module")
def expected(llama_dir) -> list[list[int]]:
    llm = LLM(llama_dir, **ENGINE)
    yield tokens(llm, prompts())
    llm.engine.shutdown()


def connector(name: str, tmp_path: Path) -> dict:
    return {"name": name, "options": {"path": str(tmp_path)}} if name == "shared_storage" else {"name": name}


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("ms")} if Path("/dev/shm").is_dir() \
        else set()


@pytest.mark.parametrize("backend", ["paged", "reference"])
@pytest.mark.parametrize("name", ["shared_storage", "shm"])
def test_consumer_answers_as_one_engine_computing_at_most_one_block(llama_dir, tmp_path, expected, name, backend):
    before = shm_segments()
    conn = connector(name, tmp_path)
    producer = LLM(llama_dir, kv_connector=conn, kv_role="producer", attention_backend=backend, **ENGINE)
    tokens(producer, prompts(), PREFILL)
    saved = producer.engine.stats()["kv_connector_blocks_saved"]
    assert saved == sum(n // BLOCK for n in LENGTHS)  # every full prompt block, the last one's too

    consumer = LLM(llama_dir, kv_connector=conn, kv_role="consumer", attention_backend=backend, **ENGINE)
    tokens(consumer, prompts(), PREFILL)  # the prefill alone: what the consumer computed of each prompt
    stats = consumer.engine.stats()
    assert stats["kv_connector_blocks_loaded"] == sum(map(usable_blocks, LENGTHS))
    assert stats["kv_connector_blocks_saved"] == 0  # a consumer never saves
    computed = stats["computed_tokens"]
    assert computed == sum(n - BLOCK * usable_blocks(n) for n in LENGTHS)
    assert computed <= BLOCK * len(LENGTHS)
    consumer.engine.shutdown()

    consumer = LLM(llama_dir, kv_connector=conn, kv_role="consumer", attention_backend=backend,
                   kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}}, **ENGINE)
    assert tokens(consumer, prompts()) == expected
    consumer.engine.shutdown()
    producer.engine.shutdown()
    assert shm_segments() == before  # the producer unlinked every segment it made
    assert not list(tmp_path.rglob("*.tmp"))  # no file left half written


def stored_files(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.rglob("*.kv"))


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_block_that_cannot_be_loaded_fails_or_is_recomputed(llama_dir, tmp_path, expected, policy, damage):
    conn = connector("shared_storage", tmp_path)
    producer = LLM(llama_dir, kv_connector=conn, kv_role="producer", **ENGINE)
    ps = prompts()
    tokens(producer, ps[2:3], PREFILL)  # the 100-token prompt's 6 blocks
    producer.engine.shutdown()
    files = stored_files(tmp_path)
    assert len(files) == 100 // BLOCK
    target = next(tmp_path.rglob(f"{llm_keys(ps[2])[3]}.kv"))  # the chain's fourth block
    if damage == "missing":  # the store then holds the blocks before it, and the consumer loads those
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:-7])
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))

    consumer = LLM(llama_dir, kv_connector=conn, kv_role="consumer", kv_load_failure_policy=policy,
                   kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}}, **ENGINE)
    outs = consumer.generate(ps[:3], GREEDY, use_tqdm=False)
    stats = consumer.engine.stats()
    if damage == "missing":  # not a failure: the store holds fewer blocks, the rest is computed
        assert [o.outputs[0].token_ids for o in outs] == expected[:3]
        assert stats["kv_connector_blocks_load_failed"] == 0
        assert stats["kv_connector_blocks_loaded"] == 3
        consumer.engine.shutdown()
        return
    assert stats["kv_connector_blocks_corrupt"] == 1
    assert outs[0].outputs[0].token_ids == expected[0]  # the others are not harmed
    assert outs[1].outputs[0].token_ids == expected[1]
    if policy == "fail":
        assert outs[2].error and "blocks could not be loaded" in outs[2].error
        assert outs[2].outputs[0].finish_reason == "error"
    else:
        assert outs[2].error is None
        assert outs[2].outputs[0].token_ids == expected[2]
    consumer.engine.shutdown()


def test_shared_storage_can_delete_what_it_wrote(llama_dir, tmp_path):
    conn = {"name": "shared_storage", "options": {"path": str(tmp_path), "delete_on_close": True}}
    producer = LLM(llama_dir, kv_connector=conn, kv_role="producer", **ENGINE)
    tokens(producer, prompts(), PREFILL)
    assert stored_files(tmp_path)
    producer.engine.shutdown()
    assert not list(tmp_path.rglob("*"))


def test_both_role_reuses_its_own_saves_after_its_cache_forgot_them(llama_dir, tmp_path, expected):
    llm = LLM(llama_dir, kv_connector=connector("shared_storage", tmp_path), **ENGINE)
    assert tokens(llm, prompts()) == expected
    llm.engine.allocator.reset_prefix_cache()
    assert tokens(llm, prompts()) == expected
    stats = llm.engine.stats()
    assert stats["kv_connector_blocks_loaded"] == sum(map(usable_blocks, LENGTHS))
    assert stats["kv_connector_blocks_saved"] == sum(n // BLOCK for n in LENGTHS)  # each once
    llm.engine.shutdown()


def test_prompts_of_other_weights_never_match(llama_dir, checkpoint_dir, tmp_path):
    other = checkpoint_dir("llama", seed=1)  # the same shape and config, other weights
    conn = connector("shared_storage", tmp_path)
    producer = LLM(llama_dir, kv_connector=conn, kv_role="producer", **ENGINE)
    tokens(producer, prompts(), PREFILL)
    consumer = LLM(other, kv_connector=conn, kv_role="consumer", **ENGINE)
    tokens(consumer, prompts(), PREFILL)
    assert consumer.engine.stats()["kv_connector_blocks_loaded"] == 0
    producer.engine.shutdown()
    consumer.engine.shutdown()


# -- the host tier ---------------------------------------------------------------------
def test_host_tier_brings_back_prefixes_the_device_cache_evicted(llama_dir):
    # 8 prompts of 96 tokens share nothing; the device holds 40 blocks (two prompts' worth
    # of cached blocks besides the running ones), the host pool all of them.
    ps = prompts(seed=3, lengths=(96,) * 8)
    small = dict(ENGINE, num_kv_blocks=40, max_model_len=256, max_num_seqs=2)
    plain = LLM(llama_dir, kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}}, **small)
    want = tokens(plain, ps)
    plain.engine.shutdown()

    tiered = LLM(llama_dir, kv_connector={"name": "host", "options": {"num_blocks": 64}}, **small)
    assert tokens(tiered, ps) == want
    first = tiered.engine.stats()
    assert first["kv_connector_host_hit_blocks"] == 0  # nothing seen twice yet
    assert tokens(tiered, ps) == want
    stats = tiered.engine.stats()
    hits = stats["kv_connector_host_hit_blocks"]
    assert hits >= 6 * usable_blocks(96)  # most prompts' blocks came back from the host
    assert stats["kv_connector_bytes_from_host"] == hits * tiered.engine.runner.kv_bytes_per_block()
    assert stats["kv_connector_host_blocks_used"] == 8 * 96 // BLOCK
    collector = EngineStatsCollector()
    collector.stats = stats
    scraped = {m.name: m for m in collector.collect()}  # what /metrics shows: hits per tier, bytes moved
    assert scraped["modserve_kv_connector_host_hit_blocks"].type == "counter"
    assert scraped["modserve_kv_connector_host_hit_blocks"].samples[0].value == hits
    assert scraped["modserve_kv_connector_bytes_to_host"].samples[0].value > 0
    assert scraped["modserve_kv_connector_host_blocks_used"].type == "gauge"
    assert scraped["modserve_prefix_cache_hit_tokens"].samples[0].value == stats["allocator_prefix_hit_tokens"]
    tiered.engine.shutdown()


def test_host_tier_evicts_its_least_recently_used_blocks(llama_dir):
    ps = prompts(seed=4, lengths=(64,) * 4)
    llm = LLM(llama_dir, kv_connector={"name": "host", "options": {"num_blocks": 8}},
              kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}}, **ENGINE)
    for p in ps:  # 16 blocks, one prompt after another, through a pool of 8: the last two prompts' remain
        tokens(llm, [p])
    stats = llm.engine.stats()
    assert stats["kv_connector_evicted_blocks"] == 8
    assert stats["kv_connector_host_blocks_used"] == 8
    assert llm.engine.runner.connector.stored_blocks(llm_keys(ps[3])) == 4
    assert llm.engine.runner.connector.stored_blocks(llm_keys(ps[0])) == 0
    tokens(llm, ps)  # in one step: the pool holds ps[2:], whose hits are loaded; ps[0:2] then evict them
    assert llm.engine.runner.connector.stored_blocks(llm_keys(ps[0])) == 4
    llm.engine.shutdown()


def llm_keys(p: list[int]) -> list[str]:
    return block_keys(p, BLOCK)


def test_block_keys_chain_every_token_before():
    a = llm_keys(list(range(48)))
    b = llm_keys([*range(16), 99, *range(17, 48)])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # a change reaches every later key
    assert len(llm_keys(list(range(47)))) == 2
    # The same in every run and process: sha256 of the parent's digest and the int64 tokens, not hash().
    first = hashlib.sha256(array("q", range(16)).tobytes()).digest()
    assert a[0] == first.hex()
    assert a[1] == hashlib.sha256(first + array("q", range(16, 32)).tobytes()).hexdigest()
    # Extended a block at a time, in place, the chain is the same; one made longer stays whole.
    chain = block_keys(list(range(48)), BLOCK, 1)
    assert block_keys(list(range(48)), BLOCK, 3, chain) is chain and chain == a
    assert block_keys(list(range(48)), BLOCK, 2, chain) == a


class EmptyStore(KVConnector):
    """Holds nothing: the scheduler plans a save of every full prompt block."""

    def stored_blocks(self, keys: list[str]) -> int:
        return 0

    def load(self, transfers: list[BlockTransfer]) -> list[int]:
        return list(range(len(transfers)))

    def save_layer(self, layer, kv_cache, transfers: list[BlockTransfer]) -> None:
        pass


def admitted(prompt: list[int], caching: bool) -> tuple[PagedAllocator, Sequence, list[str]]:
    """A scheduler step over ``prompt`` alone, blocks of 4, a connector that holds nothing: the
    allocator, the sequence and the keys of the blocks the step saves."""
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    alloc = PagedAllocator(16, 4, 64, PagedOptions(enable_prefix_caching=caching))
    core = SchedulerCore(FCFSScheduler(limits), alloc, limits, "fcfs", connector=EmptyStore(None))
    seq = Sequence(0, "a", list(prompt), len(prompt), SP(), 0.0)
    core.add(seq)
    step = core.step()
    return alloc, seq, [t.key for t in step.kv_saves[seq]]


@pytest.mark.parametrize("caching", [True, False])
def test_router_prefix_cache_and_connector_name_blocks_alike(caching):
    # With caching, the allocator's match makes the first two keys (it stops before the last
    # token) and the connector's planning the third, in the same list; without, the planning all.
    prompt = list(range(10, 22))  # three full blocks of 4
    router = Router(4, [100])
    router.choose(prompt, {0: 0})
    routed = list(router.indexes[0].hashes)
    _, seq, saved = admitted(prompt, caching)
    assert len(routed) == 3 and seq.block_hashes == routed and saved == routed


def test_prefix_cache_reads_only_its_keys_of_a_longer_chain():
    prompt = list(range(10, 22))
    alloc, seq, saved = admitted(prompt, caching=True)
    seq.num_computed_tokens = len(prompt)
    alloc.mark_computed(seq)  # publishes all three blocks, under the keys the connector saved
    alloc.free(seq)
    assert alloc.match_prefix(seq) == 8  # three keys are made, but the last token is left to compute
    again = Sequence(1, "b", list(prompt), len(prompt), SP(), 0.0)
    assert alloc.match_prefix(again) == 8 and again.block_hashes == saved[:2]  # the allocator's own


def test_connector_config_is_checked(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(llama_dir, kv_connector="shm", pipeline_parallel_size=2, **ENGINE)
    with pytest.raises(Exception, match="available|unknown|shared_storage"):
        LLM(llama_dir, kv_connector="no-such-connector", **ENGINE)


# -- tensor parallel -------------------------------------------------------------------
def test_under_tensor_parallel_each_rank_saves_and_loads_its_heads(llama_dir, tmp_path, expected):
    conn = connector("shared_storage", tmp_path)
    tp = dict(ENGINE, tensor_parallel_size=2, num_threads=1)
    producer = LLM(llama_dir, kv_connector=conn, kv_role="producer", **tp)
    tokens(producer, prompts(), PREFILL)
    producer.engine.shutdown()
    ranks = {p.parent.name: 0 for p in stored_files(tmp_path)}
    for p in stored_files(tmp_path):
        ranks[p.parent.name] += 1
    assert ranks == {"rank0": sum(n // BLOCK for n in LENGTHS), "rank1": sum(n // BLOCK for n in LENGTHS)}
    one_rank = stored_files(tmp_path)[0].stat().st_size
    # Each rank's file holds its one KV head of the tiny model's two, in every layer.
    assert one_rank == 4 + LLM_KV_BYTES_PER_BLOCK_ONE_HEAD

    consumer = LLM(llama_dir, kv_connector=conn, kv_role="consumer", **tp)
    assert tokens(consumer, prompts()) == expected
    assert consumer.engine.stats()["kv_connector_blocks_loaded"] == sum(map(usable_blocks, LENGTHS))
    consumer.engine.shutdown()

    # A block only rank 1 cannot read fails on every rank: rank 0 learns it from the all-reduce.
    target = next(tmp_path.rglob(f"rank1/{llm_keys(prompts()[2])[1]}.kv"))
    target.write_bytes(target.read_bytes()[:-4])
    consumer = LLM(llama_dir, kv_connector=conn, kv_role="consumer", kv_load_failure_policy="fail", **tp)
    outs = consumer.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.error is not None for o in outs] == [False, False, True, False, False]
    assert consumer.engine.stats()["kv_connector_blocks_load_failed"] == usable_blocks(LENGTHS[2])
    consumer.engine.shutdown()


# tiny llama: 2 layers x (k, v) x 16 tokens x 1 KV head x head_dim 16 x 4 bytes (float32)
LLM_KV_BYTES_PER_BLOCK_ONE_HEAD = 2 * 2 * BLOCK * 1 * 16 * 4
