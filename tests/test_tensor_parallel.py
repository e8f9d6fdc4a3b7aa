"""Tensor parallelism: every quantizer's shards, and TP=2 engines against TP=1 and transformers.

Two parts:

- In-process, no workers: each quantizer's layers built for rank 0 and rank 1 of two
  (``TensorParallel(rank, 2)``) from the same checkpoint tensors as a whole layer. A
  column-parallel shard must dequantize to exactly its rows of the whole layer's weight
  (KV heads replicated when there are fewer than ranks), a row-parallel one to its
  columns; the shards' matmuls must add up to (row) or concatenate to (column) the whole
  layer's. Int8 and fp8 quantize at load: a row shard's per-channel scales are its own.
- End to end, ``tensor_parallel_size=2`` (the ``mp`` executor, gloo): one TP=1 and one TP=2
  engine per checkpoint, each run once on the same workload (8 prompts of different
  lengths submitted together, prefix caching, chunked prefill, preemption); the tests
  compare what they recorded. Each engine is shut down before the next starts, and must
  leave no KV block in use and no child process alive.
"""

from __future__ import annotations

import importlib.metadata as md
import multiprocessing
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.runner.linear import LinearFactory, finish_linears
from modserve.runner.parallel import TensorParallel
from modserve.core.registry import Registry
from modserve.quantizers.awq import AWQ, AWQOptions
from modserve.quantizers.fp8 import FP8Options, FP8Weights
from modserve.quantizers.gptq import GPTQ, GPTQOptions
from modserve.quantizers.int8 import Int8, Int8Options
from modserve.testing import (
    AWQ_PACK_ORDER, act_order_g_idx, awq_quantize, cached_checkpoint, cached_quantized_checkpoint, gptq_quantize,
    pack_int32,
)
from modserve.testing.conformance.quantized_layers import TP_LAYERS, rank_rows as kit_rank_rows

TP = 2
GROUP = 32


# -- in-process: each quantizer's shards -----------------------------------------------------
# The tiny Llama's projections, MQA (1 KV head of 16, replicated on both ranks): name ->
# (in, shard sizes, parallel, shard replicas at TP=2); the conformance kit's, which checks
# any quantizer's shards the same way (its test_quantizer.py).
LAYERS = TP_LAYERS
# name -> (quantizer class, options class, checkpoint quantization_config)
QUANTIZERS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "awq": (AWQ, AWQOptions, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                              "version": "gemm"}),
    "gptq4": (GPTQ, GPTQOptions, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False}),
    "gptq4-act-order": (GPTQ, GPTQOptions, {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                            "desc_act": True}),
    "gptq4-one-group": (GPTQ, GPTQOptions, {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False}),
    "gptq8-v2": (GPTQ, GPTQOptions, {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False,
                                     "checkpoint_format": "gptq_v2"}),
    "int8": (Int8, Int8Options, {}),
    "fp8": (FP8Weights, FP8Options, {}),
}
# Kernels each runs here: auto (dequant on CPU; what a user gets) and dequant named.
CASES = [(m, k) for m in QUANTIZERS for k in ("auto", "dequant") if not (m in ("gptq8-v2", "fp8") and k == "auto")]
QUANTIZE_AT_LOAD = ("int8", "fp8")  # a row shard's per-channel scales are its own, not the whole row's


def checkpoint_tensors(method: str, w: torch.Tensor, seed: object) -> dict[str, torch.Tensor]:
    """One checkpoint linear ``w [N, K]`` as ``method`` stores it (``seed``: its act order,
    shared by the shards of a fused layer, which read the same input)."""
    cfg = QUANTIZERS[method][2]
    if method in QUANTIZE_AT_LOAD:
        return {"weight": w}
    if method == "awq":
        q, z, s = awq_quantize(w, GROUP)
        return {"qweight": pack_int32(q, 4, dim=1, order=AWQ_PACK_ORDER),
                "qzeros": pack_int32(z, 4, dim=1, order=AWQ_PACK_ORDER), "scales": s}
    k, bits, g = w.shape[1], cfg["bits"], cfg["group_size"]
    if g == -1:
        g_idx = torch.zeros(k, dtype=torch.int32)
    elif cfg["desc_act"]:
        g_idx = act_order_g_idx(k, g, seed)
    else:
        g_idx = torch.arange(k, dtype=torch.int32) // g
    q, z, s = gptq_quantize(w, bits, g, g_idx)
    stored = z if cfg.get("checkpoint_format") == "gptq_v2" else z - 1
    return {"qweight": pack_int32(q, bits, dim=0), "qzeros": pack_int32(stored, bits, dim=1), "scales": s,
            "g_idx": g_idx}


def build(method: str, kernel: str, layer: str, tp: TensorParallel, shards: list[dict[str, torch.Tensor]],
          in_features: int | None = None):
    cls, options, cfg = QUANTIZERS[method]
    quantizer = cls(cfg, options(kernel=kernel)) if cfg else cls(options=options(kernel=kernel))
    k, sizes, parallel, replicas = LAYERS[layer]
    make = LinearFactory(quantizer, torch.float32, "cpu", tp=tp)
    linear = make(in_features or k, sum(sizes), shard_sizes=sizes, parallel=parallel if in_features is None else None,
                  shard_replicas=replicas)
    for shard, tensors in enumerate(shards):
        for name, t in tensors.items():
            linear.load(name, t, shard)
    finish_linears(linear)
    return linear


def rank_rows(layer: str, rank: int) -> torch.Tensor:
    """The whole layer's output rows that rank ``rank`` of TP holds, in its order."""
    _, sizes, _, replicas = LAYERS[layer]
    return kit_rank_rows(sizes, replicas, TensorParallel(rank, TP))


def kept_bytes(linear) -> int:
    tensors = [t for name, t in [*linear.named_parameters(), *linear.named_buffers()] if name != "bias"]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("method,kernel", CASES)
def test_quantizer_shards_are_slices_of_the_whole_layer(method, kernel):
    gen = torch.Generator().manual_seed(0)
    for layer, (k, sizes, parallel, _) in LAYERS.items():
        weights = [torch.randn(n, k, generator=gen) * 0.05 for n in sizes]
        shards = [checkpoint_tensors(method, w, (layer, k)) for w in weights]
        whole = build(method, kernel, layer, TensorParallel(), shards)
        w = whole.quantizer.dequantize(whole)  # [out, in]
        x = torch.randn(5, k, generator=gen)
        y = whole.quantizer.apply(whole, x)  # [5, out]
        parts = []
        for rank in range(TP):
            tp = TensorParallel(rank, TP)
            part = build(method, kernel, layer, tp, shards)
            spec, got = part.spec, part.quantizer.dequantize(part)
            assert part.quantizer.weight_bytes(spec) == kept_bytes(part), f"{layer} rank {rank}: planned bytes"
            if parallel == "column":
                rows = rank_rows(layer, rank)
                assert torch.equal(got, w[rows]), f"{layer} rank {rank}: not its rows of the weight"
                torch.testing.assert_close(part.quantizer.apply(part, x), y[:, rows], atol=1e-4, rtol=1e-4)
                continue
            cols = slice(spec.in_start, spec.in_start + spec.in_features)
            if method in QUANTIZE_AT_LOAD:
                # quantized from its own columns of the float weight: what a whole layer of them holds
                alone = build(method, kernel, layer, TensorParallel(), [{"weight": weights[0][:, cols]}],
                              in_features=spec.in_features)
                assert torch.equal(got, alone.quantizer.dequantize(alone)), f"{layer} rank {rank}"
                torch.testing.assert_close(got, weights[0][:, cols], atol=0.05 * 0.2, rtol=0.1)
            else:
                assert torch.equal(got, w[:, cols]), f"{layer} rank {rank}: not its columns of the weight"
            parts.append(part.quantizer.apply(part, x[:, cols].contiguous()))
            assert part.kernel == ("dequant" if kernel == "auto" and method == "gptq4-act-order" else
                                   whole.kernel), f"{layer} rank {rank}: kernel"
        if parallel == "row":  # the ranks' partial sums: what Linear all-reduces
            tol = {"int8": 0.02, "fp8": 0.1}.get(method, 1e-4)  # at load: other scales, other rounding
            torch.testing.assert_close(sum(parts), y, atol=tol, rtol=0 if tol > 1e-4 else 1e-4)


def test_int4pack_refuses_a_row_shard_of_an_act_order_checkpoint():
    gen = torch.Generator().manual_seed(1)
    shards = [checkpoint_tensors("gptq4-act-order", torch.randn(64, 64, generator=gen) * 0.05, "o")]
    build("gptq4-act-order", "int4pack", "o_proj", TensorParallel(), shards)  # whole: its groups are whole
    with pytest.raises(ValueError, match="int4pack cannot run a row-parallel shard"):
        build("gptq4-act-order", "int4pack", "o_proj", TensorParallel(1, TP), shards)


def test_an_act_order_g_idx_in_a_checkpoint_that_says_otherwise_is_an_error():
    """A row shard of a desc_act=False checkpoint keeps only its own groups, so a g_idx
    that names others must fail at load, not index out of range in a step."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=gen) * 0.05
    tensors = checkpoint_tensors("gptq4", w, "o")
    tensors["g_idx"] = act_order_g_idx(64, GROUP, "o")  # permuted, but the config says in order
    with pytest.raises(ValueError, match="g_idx names groups outside"):
        build("gptq4", "dequant", "o_proj", TensorParallel(1, TP), [tensors])


# -- end to end: TP=2 engines against TP=1 ----------------------------------------------------
MAX_NEW, SECOND_NEW, LOGPROBS = 10, 4, 3
LENGTHS = (3, 9, 14, 20, 27, 33, 41, 50)
# Block size 4 and 32 blocks (128 tokens) for ~280 tokens of work: sequences are preempted
# (recompute); long_prefill_token_threshold 8: every prompt over 8 tokens is prefilled in chunks.
ENGINE: dict[str, Any] = dict(
    dtype="float32", num_threads=1, max_model_len=128, block_size=4, num_kv_blocks=32, max_num_batched_tokens=64,
    scheduler={"name": "fcfs", "options": {"long_prefill_token_threshold": 8}}, progress=False)


def prompts_for(vocab_size: int) -> list[list[int]]:
    """8 prompts, lengths 3 to 50; all but the shortest start with the same 12 tokens."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab_size) for _ in range(12)]
    return [(prefix if n > 12 else [])[:n] + [rng.randrange(3, vocab_size) for _ in range(n - (12 if n > 12 else 0))]
            for n in LENGTHS]


@dataclass
class Run:
    """What one engine did with the workload."""

    tokens: list[list[int]]  # round 1: greedy, MAX_NEW tokens each
    logprobs: list[list[dict[str, Any]]]  # round 1: each token's entry (logprob, top LOGPROBS)
    prompt_logprobs: dict[int, list[dict[str, Any] | None]]  # round 1, the even prompts: every prompt token's
    tokens2: list[list[int]]  # round 2: the same prompts again, SECOND_NEW tokens each
    cached2: int  # round 2's prompt tokens found in the prefix cache
    stats: dict[str, Any]  # after both rounds
    children: list[str]  # processes alive after shutdown
    seconds: float


def run_workload(llm: LLM) -> dict[str, Any]:
    """The workload on ``llm``: a Run's fields from ``tokens`` to ``stats``."""
    prompts = prompts_for(llm.engine.runner.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=LOGPROBS,
                             prompt_logprobs=LOGPROBS if i % 2 == 0 else None) for i in range(len(prompts))]
    first = llm.generate(prompts, params, use_tqdm=False)  # all 8 submitted together
    hits = llm.engine.stats()["allocator_prefix_hit_tokens"]
    second = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=SECOND_NEW, ignore_eos=True),
                          use_tqdm=False)
    stats = llm.engine.stats()
    return dict(tokens=[o.outputs[0].token_ids for o in first], logprobs=[o.outputs[0].logprobs for o in first],
                prompt_logprobs={i: o.prompt_logprobs for i, o in enumerate(first) if o.prompt_logprobs},
                tokens2=[o.outputs[0].token_ids for o in second],
                # NOTE: not RequestOutput.num_cached_tokens, which the engine leaves 0
                cached2=stats["allocator_prefix_hit_tokens"] - hits, stats=stats)


def run_engine(path: str, tp: int, registry: Registry | None = None, **overrides: Any) -> Run:
    start = time.monotonic()
    llm = LLM(path, **{**ENGINE, **overrides}, tensor_parallel_size=tp, registry=registry)
    try:
        assert llm.engine.runner.tp.size == tp
        fields = run_workload(llm)
    finally:
        llm.engine.shutdown()
    return Run(**fields, children=[p.name for p in multiprocessing.active_children()],
               seconds=time.monotonic() - start)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    return os.environ.get("MODSERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("checkpoints"))


# name -> how to get the checkpoint (the cache root as argument)
CHECKPOINTS = {
    "llama-gqa": lambda root: cached_checkpoint("llama", cache_dir=root),  # 4 heads, 2 KV heads: one per rank
    "llama-mqa": lambda root: cached_checkpoint("llama", cache_dir=root, num_key_value_heads=1),  # replicated
    "qwen2": lambda root: cached_checkpoint("qwen2", cache_dir=root),  # q/k/v biases, tied embeddings
    "mistral": lambda root: cached_checkpoint("mistral", cache_dir=root),
    "odd-vocab": lambda root: cached_checkpoint("llama", cache_dir=root, vocab_size=4001),  # padded to 4096
    "awq": lambda root: cached_quantized_checkpoint("awq", cache_dir=root),
    "gptq": lambda root: cached_quantized_checkpoint("gptq", cache_dir=root),
    "gptq-act-order": lambda root: cached_quantized_checkpoint("gptq", cache_dir=root, desc_act=True),
    "int8": lambda root: cached_checkpoint("llama", cache_dir=root),
}
OVERRIDES: dict[str, dict[str, Any]] = {"int8": {"quantization": "int8"}}


@pytest.fixture(scope="module")
def runs(cache_root):
    """``runs(name, tp)``: the workload on that checkpoint at that TP size, each engine run once."""
    done: dict[tuple[str, int], Run] = {}

    def get(name: str, tp: int) -> Run:
        if (name, tp) not in done:
            done[(name, tp)] = run_engine(str(CHECKPOINTS[name](cache_root)), tp, **OVERRIDES.get(name, {}))
        return done[(name, tp)]

    return get


def assert_engine_was_clean(run: Run) -> None:
    assert run.stats["kv_blocks_free"] == run.stats["kv_blocks_total"], "KV blocks left in use"
    assert run.children == [], f"processes alive after shutdown: {run.children}"


def assert_workload_exercised(run: Run) -> None:
    """Preemption and prefix caching happened (chunked prefill does by the config: at most 8
    tokens of a prompt per step, prompts up to 50)."""
    assert run.stats["num_preemptions"] > 0, "no sequence was preempted"
    assert run.cached2 > 0, "the second round found no cached prefix"


def max_logprob_diff(a: Run, b: Run) -> float:
    """Max |difference| over every logprob both runs report: each generated token's and its
    top alternatives', and every prompt token's of the even prompts (with their top)."""
    def entries(run: Run) -> list[dict[str, Any]]:
        out = [e for seq in run.logprobs for e in seq]
        return out + [e for i in sorted(run.prompt_logprobs) for e in run.prompt_logprobs[i][1:]]

    worst = 0.0
    ea, eb = entries(a), entries(b)
    assert len(ea) == len(eb) and ea, "the runs report different logprobs"
    for x, y in zip(ea, eb):
        assert x["token_id"] == y["token_id"]
        assert set(x["top"]) == set(y["top"]), "different top tokens"
        worst = max(worst, abs(x["logprob"] - y["logprob"]), *(abs(x["top"][t] - y["top"][t]) for t in x["top"]))
    return worst


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mqa", "qwen2", "mistral", "odd-vocab"])
def test_tp2_equals_tp1(runs, name):
    one, two = runs(name, 1), runs(name, TP)
    for run in (one, two):
        assert_engine_was_clean(run)
        assert_workload_exercised(run)
    assert two.tokens == one.tokens
    assert two.tokens2 == one.tokens2 == [t[:SECOND_NEW] for t in one.tokens]
    assert all(len(run.prompt_logprobs[i]) == LENGTHS[i] for run in (one, two) for i in run.prompt_logprobs)
    assert max_logprob_diff(one, two) < 1e-4


def test_tp2_greedy_matches_transformers(runs, cache_root):
    from transformers import AutoModelForCausalLM

    path = str(CHECKPOINTS["llama-gqa"](cache_root))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts_for(model.config.vocab_size):
            gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
            expected.append(gen[0, len(p):].tolist())
    assert runs("llama-gqa", TP).tokens == expected


@pytest.mark.parametrize("name", ["awq", "gptq", "gptq-act-order"])
def test_quantized_tp2_equals_tp1(runs, name):
    """The same integer weights and scales on both: only the order of the row-parallel sums differs."""
    one, two = runs(name, 1), runs(name, TP)
    for run in (one, two):
        assert_engine_was_clean(run)
        assert_workload_exercised(run)
    assert two.tokens == one.tokens
    assert two.tokens2 == one.tokens2
    assert max_logprob_diff(one, two) < 1e-4


def test_int8_tp2_is_near_tp1(runs):
    """Int8 quantizes at load, one scale per output channel over that channel's inputs. A
    column-parallel shard holds whole rows, so its weights are TP=1's exactly (the in-process
    test above); a row-parallel one (o_proj, down_proj) scales its half of the inputs on
    its own: other, finer int8 weights than TP=1's. So the logits differ by int8 rounding,
    not float rounding, and a greedy continuation of this random model parts from TP=1's
    once a near-tie flips (measured: 74 of 80 tokens equal, one prompt parting after 4).
    Asserted: every prompt's first token equal, at least 3/4 of all tokens equal, and the
    prompt logprobs no further from the float model's than twice TP=1 int8's distance."""
    one, two, float_run = runs("int8", 1), runs("int8", TP), runs("llama-gqa", 1)
    for run in (one, two):
        assert_engine_was_clean(run)
    assert [t[0] for t in two.tokens] == [t[0] for t in one.tokens]
    same = sum(a == b for x, y in zip(one.tokens, two.tokens) for a, b in zip(x, y))
    assert same >= 0.75 * MAX_NEW * len(LENGTHS), f"{same} of {MAX_NEW * len(LENGTHS)} tokens equal"

    def error(run: Run) -> float:  # max |logprob - the float model's| over the prompt tokens
        return max(abs(x["logprob"] - y["logprob"]) for i in run.prompt_logprobs
                   for x, y in zip(run.prompt_logprobs[i][1:], float_run.prompt_logprobs[i][1:]))

    assert 0 < error(one) < 0.1  # int8, not float
    assert error(two) < 2 * error(one), (error(two), error(one))


# -- plugins reach the workers ---------------------------------------------------------------
EXAMPLE_DIST = "modserve-example-plugin"


def test_the_drivers_plugins_run_on_every_rank(runs, cache_root, tmp_path, monkeypatch):
    """One TP=2 engine with the example plugin distribution's attention backend and a
    sampler registered as a module in this process (tests/tp_module_plugin.py). Rank 1 finds
    the first only if it loads the distributions the driver loaded (the tests' env allows
    the built-ins only), the second only if it imports the driver's module plugins; each
    rank builds both. The tokens must be TP=1's with the built-ins."""
    import tp_module_plugin

    try:
        md.distribution(EXAMPLE_DIST)
    except md.PackageNotFoundError:
        pytest.fail(f"{EXAMPLE_DIST} is not installed: make install, or pip install examples/{EXAMPLE_DIST}")
    registry = Registry()
    registry.load_entrypoints(allow={EXAMPLE_DIST})
    registry.add_plugin(tp_module_plugin, "tp-module-plugin")
    assert {EXAMPLE_DIST, "module:tp_module_plugin"} <= set(registry.sources())
    monkeypatch.setenv(tp_module_plugin.MARKERS, str(tmp_path))
    run = run_engine(str(CHECKPOINTS["llama-gqa"](cache_root)), TP, registry=registry,
                     attention_backend="example_sdpa", sampler=tp_module_plugin.NAME)
    assert_engine_was_clean(run)
    makers = {int(p.name) for p in tmp_path.iterdir()}
    assert os.getpid() in makers and len(makers) == TP, f"the module's sampler was made in {makers}"
    one = runs("llama-gqa", 1)
    assert run.tokens == one.tokens and run.tokens2 == one.tokens2
    assert max_logprob_diff(one, run) < 1e-4
