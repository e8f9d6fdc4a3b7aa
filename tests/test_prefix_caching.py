"""Prefix caching, copy-on-write forks (n > 1), swap preemption and the contiguous baseline."""

from __future__ import annotations

import pytest

from modserve import LLM, SamplingParams
from modserve.core.sampling_params import SamplingParams as SP
from modserve.core.sequence import Sequence
from modserve.plugins.kv_allocators.paged import PagedAllocator, PagedOptions

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SYSTEM = "You are a helpful assistant. Answer briefly and use the model token cache. " * 3


def make_llm(path: str, caching: bool = True, allocator: str = "paged", **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    return LLM(path, dtype="float32", progress=False,
               kv_allocator={"name": allocator, "options": {"enable_prefix_caching": caching}}, **overrides)


def workload(tok) -> list[list[list[int]]]:
    """Waves of prompts, run one after another so later waves can hit what earlier ones cached."""
    system = tok.encode(SYSTEM)
    odd = system[:37]  # a shared prefix ending mid-block (block_size 16)
    return [
        [system + tok.encode(" first question")],
        [system + tok.encode(f" question number {i}") for i in range(4)],
        [odd + tok.encode(" and now something else"), odd + tok.encode(" or that")],
        [system + tok.encode(" first question")] * 3,  # repeated identical prompts
        [tok.encode("unrelated prompt with no shared prefix at all, none")],
    ]


def run_waves(llm: LLM, waves) -> list[list[int]]:
    return [o.outputs[0].token_ids for wave in waves for o in llm.generate(wave, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_output_identical_with_caching_on_and_off(llama_dir, allocator):
    off = make_llm(llama_dir, caching=False)
    waves = workload(off.get_tokenizer())
    expected = run_waves(off, waves)
    on = make_llm(llama_dir, allocator=allocator)
    assert run_waves(on, waves) == expected
    stats = on.engine.stats()
    assert stats["allocator_prefix_hit_tokens"] > 0.5 * stats["allocator_prefix_queried_tokens"]
    assert on.engine.counters["computed_tokens"] < off.engine.counters["computed_tokens"]
    # Eviction pressure: a pool that cannot keep everything cached.
    tight = make_llm(llama_dir, allocator=allocator, num_kv_blocks=8, max_model_len=128)
    assert run_waves(tight, waves) == expected
    assert tight.engine.stats()["allocator_evictions"] > 0


def test_shared_system_prompt_skips_prefill(llama_dir):
    llm = make_llm(llama_dir, num_kv_blocks=256, max_model_len=1024)
    tok = llm.get_tokenizer()
    system = tok.encode("system: " + "model token cache batch queue layer " * 100)[:512]
    prompts = [system + tok.encode(f" user {i}: tell me about item {i}") for i in range(16)]
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:1], one, use_tqdm=False)
    before = llm.engine.counters["computed_tokens"]
    llm.generate(prompts[1:], one, use_tqdm=False)
    computed = llm.engine.counters["computed_tokens"] - before
    total = sum(len(p) for p in prompts[1:])
    assert computed <= 0.1 * total, f"computed {computed} of {total} prompt tokens"
    # and the answers equal an uncached engine's
    ref = make_llm(llama_dir, caching=False, num_kv_blocks=256, max_model_len=1024)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_swap_and_recompute_preemption_match_unpreempted(llama_dir, allocator):
    prompts = [f"prompt {i}: " + "the model token cache " * (3 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate(prompts, params, use_tqdm=False)]
    for mode in ("recompute", "swap"):
        llm = make_llm(llama_dir, allocator=allocator, num_kv_blocks=12, max_model_len=192, preemption_mode=mode, num_swap_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats[f"preemptions_{mode}"] > 0, stats
        if mode == "swap":
            assert stats["blocks_swapped_out"] > 0 and stats["blocks_swapped_in"] == stats["blocks_swapped_out"]
            assert stats["preemptions_recompute"] == 0
        assert [o.outputs[0].token_ids for o in outs] == expected, mode


def test_seeded_sampling_identical_under_swap(llama_dir):
    prompts = [f"prompt {i}: " + "queue layer " * (2 + i) for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate(prompts, params, use_tqdm=False)]
    llm = make_llm(llama_dir, num_kv_blocks=10, max_model_len=160, preemption_mode="swap", num_swap_blocks=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.stats()["preemptions_swap"] > 0


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_n4_shares_prompt_blocks(llama_dir, allocator):
    llm = make_llm(llama_dir, allocator=allocator, num_kv_blocks=256, max_model_len=512)
    eng = llm.engine
    tok = llm.get_tokenizer()
    prompt = tok.encode("shared prompt " * 40)[:103]  # ends mid-block: the partial block is copied on write
    eng.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True))
    peak, outs = 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs = o
        peak = max(peak, eng.num_blocks - eng.allocator.num_free_blocks())
    prompt_blocks = -(-len(prompt) // 16)
    gen_blocks = -(-20 // 16)
    assert peak <= prompt_blocks + 4 * gen_blocks + 4, peak
    assert eng.counters["computed_tokens"] == len(prompt) + 4 * 19  # one prefill; each sample decodes
    samples = [c.token_ids for c in outs.outputs]
    assert [c.index for c in outs.outputs] == [0, 1, 2, 3] and len({tuple(s) for s in samples}) == 4
    # Each sample equals a lone request seeded as that sample is (seed + index): shared
    # blocks were never written in place.
    for i, s in enumerate(samples):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=20, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        assert s == alone, i


def test_n_greedy_samples_equal_single(llama_dir):
    llm = make_llm(llama_dir)
    single = llm.generate(["hello there friend"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(["hello there friend"], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3


def test_abort_with_pending_forks_frees_everything(llama_dir):
    llm = make_llm(llama_dir)
    eng = llm.engine
    eng.add_request("x", "a prompt to fork", SamplingParams(n=3, max_tokens=5))
    eng.abort_request("x")
    eng.add_request("y", "a prompt to fork", SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    out = eng.abort_request("y")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3


def test_contiguous_allocator_same_output_fewer_concurrent(llama_dir):
    prompts = [f"request {i} " + "cache " * i for i in range(8)]
    paged = make_llm(llama_dir, num_kv_blocks=32, max_model_len=128)
    contiguous = LLM(llama_dir, dtype="float32", progress=False, num_kv_blocks=32, max_model_len=128,
                     kv_allocator="contiguous")
    peak = {}
    results = {}
    for name, llm in (("paged", paged), ("contiguous", contiguous)):
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, GREEDY)
        outs, peak[name] = {}, 0
        while eng.has_unfinished_requests():
            peak[name] = max(peak[name], len(eng.scheduler.running))
            for o in eng.step():
                outs[o.request_id] = o.outputs[0].token_ids
        results[name] = [outs[str(i)] for i in range(len(prompts))]
    assert results["paged"] == results["contiguous"]
    assert peak["contiguous"] == 32 // (128 // 16) == 4  # one max_model_len slab per sequence
    assert peak["paged"] == 8


# -- the allocator on its own ------------------------------------------------------------
def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), list(tokens), len(tokens), SP(), 0.0)


def test_allocator_chains_keys_and_evicts_lru():
    alloc = PagedAllocator(num_blocks=6, block_size=4, max_model_len=64, options=PagedOptions())
    a = seq(0, list(range(9)))  # 2 full blocks + 1 token
    assert alloc.match_prefix(a) == 0 and alloc.allocate(a, 9)
    a.num_computed_tokens = 9
    alloc.mark_computed(a)
    a_blocks = list(a.block_ids)
    alloc.free(a)
    assert alloc.num_free_blocks() == 6 and alloc.stats()["cached_blocks"] == 2
    # Same second block, different first block: the chain must not match block 2 alone.
    b = seq(1, [99, 1, 2, 3] + list(range(4, 9)))
    assert alloc.match_prefix(b) == 0
    alloc.free(b)
    c = seq(2, list(range(12)))  # the first 8 tokens match; 12 tokens leave the 3rd block uncached
    assert alloc.match_prefix(c) == 8 and c.block_ids == a_blocks[:2]
    alloc.free(c)
    # Fill the pool: plain free blocks go first, then cached ones, least recently freed first.
    d = seq(3, list(range(100, 124)))
    assert alloc.allocate(d, 24)
    assert alloc.stats()["evictions"] == 2 and alloc.stats()["cached_blocks"] == 0
    alloc.free(d)
    assert alloc.num_free_blocks() == 6


def test_allocator_copy_on_write():
    alloc = PagedAllocator(num_blocks=8, block_size=4, max_model_len=64)
    parent = seq(0, list(range(6)))
    assert alloc.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = seq(1, list(range(6)))
    child.num_computed_tokens = 6
    alloc.fork(parent, child)
    assert child.block_ids == parent.block_ids and alloc.num_free_blocks() == 6
    shared_partial = parent.block_ids[1]
    assert alloc.blocks_needed(child, 7) == 1  # the partial block must be copied first
    assert alloc.allocate(child, 7)
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != shared_partial
    assert alloc.take_copies() == [(shared_partial, child.block_ids[1])] and alloc.take_copies() == []
    assert alloc.blocks_needed(parent, 7) == 0  # now the parent holds it alone
    alloc.free(parent)
    alloc.free(child)
    assert alloc.num_free_blocks() == 8


def test_reset_prefix_cache_makes_the_next_run_compute_its_prompt(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, max_model_len=512, progress=False)
    prompt = list(range(10, 74))  # 4 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    before = llm.engine.stats()["computed_tokens"]
    llm.generate([prompt], params, use_tqdm=False)
    cached_run = llm.engine.stats()["computed_tokens"] - before
    llm.reset_prefix_cache()
    assert llm.engine.allocator.stats()["cached_blocks"] == 0
    before = llm.engine.stats()["computed_tokens"]
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats()["computed_tokens"] - before > cached_run + 40  # the prompt again, in full
    assert again == first
