"""Qwen3 and the mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers.

The oracle is transformers on the same random weights in float32: greedy tokens must match
exactly and prefill logits within 1e-4, with prefix caching on and prompts prefilled in
chunks, through each MoE backend. Both checkpoint layouts of the experts (transformers 4's
per-expert tensors, which transformers 5 still writes by default, and transformers 5's fused
3-D tensors) must load to the same logits.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_oracle import PROMPTS, greedy_and_logits
from modserve import LLM, SamplingParams
from modserve.core.sequence import Sequence
from modserve.plugins.models.moe import expert_share

ARCHS = ["qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
MOE_ARCHS = ARCHS[1:]
NO_FUSED = pytest.mark.skipif(importlib.util.find_spec("modserve.plugins.moe.fused") is None,
                              reason="the fused MoE backend is not written yet")
# Qwen3 is dense: the MoE backend doesn't touch it, so it runs once.
CASES = [pytest.param("qwen3", "reference", id="qwen3")] + [
    pytest.param(arch, backend, id=f"{arch}-{backend}", marks=[NO_FUSED] if backend == "fused" else [])
    for arch in MOE_ARCHS for backend in ("reference", "fused")]
MAX_NEW = 10
# Prefix caching on, block size 4, and a 16-token step budget: the longer prompts are
# prefilled in chunks, several prompts share a step, and the shared-prefix ones hit the cache.
ENGINE = dict(dtype="float32", num_kv_blocks=512, block_size=4, max_num_batched_tokens=16,
              kv_allocator={"name": "paged", "options": {"enable_prefix_caching": True}}, progress=False)


@pytest.fixture(scope="module")
def hf_reference(checkpoint_dir):
    """Per arch: checkpoint, prompt ids, HF greedy continuations, HF prefill logits."""
    refs = {}
    for arch in ARCHS:
        path = checkpoint_dir(arch)
        refs[arch] = (path, *greedy_and_logits(path, PROMPTS, MAX_NEW))
    return refs


def prefill_logits(llm: LLM, ids: list[list[int]]) -> list[torch.Tensor]:
    """The model's logits ``[P, V]`` for every prompt, all prompts in one forward."""
    eng = llm.engine
    seqs = [Sequence(i, f"r{i}", list(p), len(p), SamplingParams(), 0.0) for i, p in enumerate(ids)]
    for s in seqs:
        assert eng.allocator.allocate(s, s.num_tokens)
    try:
        runner = eng.runner
        batch = runner._prepare(seqs, [s.num_tokens for s in seqs])
        meta = batch.meta
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, meta.positions, runner.kv_caches, meta, runner.attn.prepare(meta))
            logits = runner.model.compute_logits(hidden)
        return list(torch.split(logits, [len(p) for p in ids]))
    finally:
        for s in seqs:
            eng.allocator.free(s)


@pytest.mark.parametrize("arch,moe_backend", CASES)
def test_greedy_matches_transformers(hf_reference, arch, moe_backend):
    path, ids, expected, _ = hf_reference[arch]
    assert len({len(p) for p in ids}) == len(ids), "prompts should differ in length"
    llm = LLM(path, moe_backend=moe_backend, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(ids, params, use_tqdm=False)  # all 8 submitted together
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(map(len, ids)) > ENGINE["max_num_batched_tokens"], "some prompt must be prefilled in chunks"
    again = llm.generate(ids, params, use_tqdm=False)  # now from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.engine.stats()["allocator_prefix_hit_tokens"] > 0


@pytest.mark.parametrize("arch,moe_backend", CASES)
def test_prefill_logits_match_transformers(hf_reference, arch, moe_backend):
    path, ids, _, expected = hf_reference[arch]
    llm = LLM(path, moe_backend=moe_backend, **ENGINE)
    for got, want in zip(prefill_logits(llm, ids), expected):
        assert (got - want).abs().max().item() < 1e-4


def test_checkpoints_have_both_layer_kinds_and_real_routing(hf_reference):
    """The presets exercise what they should: dense and sparse layers, and routing that uses
    most experts with no near-tie at the top-k cut (float error could flip those choices)."""
    from modserve.plugins.models.moe import SparseMoeBlock

    kinds = {}
    for arch in MOE_ARCHS:
        path, ids, _, _ = hf_reference[arch]
        llm = LLM(path, moe_backend="reference", **ENGINE)
        blocks = [layer.mlp for layer in llm.engine.runner.model.layers]
        kinds[arch] = [isinstance(b, SparseMoeBlock) for b in blocks]
        logits: list[torch.Tensor] = []
        hooks = [b.gate.register_forward_hook(lambda m, args, out: logits.append(out))
                 for b in blocks if isinstance(b, SparseMoeBlock)]
        prefill_logits(llm, ids)
        for h in hooks:
            h.remove()
        for block, layer_logits in zip([b for b in blocks if isinstance(b, SparseMoeBlock)], logits):
            probs = layer_logits.float().softmax(-1).sort(dim=-1, descending=True).values  # [T, E]
            used = layer_logits.topk(block.top_k, dim=-1).indices.unique().numel()
            assert used >= 0.75 * len(block.experts.gate_up)
            assert (probs[:, block.top_k - 1] - probs[:, block.top_k]).min() > 1e-6
    assert kinds == {"mixtral": [True] * 3, "qwen2_moe": [False, True, False, True],
                     "qwen3_moe": [False, True, True, True]}


def test_a_compiled_moe_model_gives_transformers_tokens(hf_reference):
    """Under compile: on the routed experts are one opaque op in each layer's graph (Qwen2-MoE:
    a graph for its dense layers and one for its sparse ones, the shared expert in-graph); the
    tokens are transformers', and the op still counts the per-expert load."""
    path, ids, expected, _ = hf_reference["qwen2_moe"]
    llm = LLM(path, compile="on", **ENGINE)
    assert llm.engine.runner.compiled
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    load = llm.engine.stats()["expert_tokens"]
    assert load and len({sum(per_layer) for per_layer in load.values()}) == 1 and sum(next(iter(load.values())))


# -- checkpoint layouts ------------------------------------------------------------------
_PER_EXPERT = re.compile(r"^(.*\.)(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_V4_NAMES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def to_fused_layout(src: Path, out: Path) -> Path:
    """Copy checkpoint ``src`` with its per-expert tensors rewritten as transformers 5 holds
    them: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first), ``mlp.experts.down_proj``
    ``[E, H, I]``, and Mixtral's ``block_sparse_moe`` renamed ``mlp``."""
    shutil.copytree(src, out)
    weights = load_file(src / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in weights.items():
        if m := _PER_EXPERT.match(name):
            layer, _, e, kind = m.groups()
            experts.setdefault(layer, {}).setdefault(_V4_NAMES[kind], {})[int(e)] = t
        else:
            fused[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer, parts in experts.items():
        n = len(parts["gate"])
        fused[f"{layer}mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)])
        fused[f"{layer}mlp.experts.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    save_file(fused, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_both_expert_layouts_load_to_the_same_logits(hf_reference, arch, tmp_path):
    path, ids, _, expected = hf_reference[arch]
    names = load_file(Path(path, "model.safetensors"))
    assert any(".experts.0." in n for n in names), "transformers should write the per-expert layout"
    fused = to_fused_layout(Path(path), tmp_path / "fused")
    # The rewrite is what transformers 5 itself holds: same names and shapes as its state dict.
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_shapes = {n: tuple(t.shape) for n, t in hf_model.state_dict().items()}
    ours = {n: tuple(t.shape) for n, t in load_file(fused / "model.safetensors").items()}
    fused_shapes = {n: s for n, s in ours.items() if "experts" in n}
    assert fused_shapes and fused_shapes == {n: s for n, s in hf_shapes.items() if "experts" in n}
    per_expert = prefill_logits(LLM(path, moe_backend="reference", **ENGINE), ids)
    stacked = prefill_logits(LLM(str(fused), moe_backend="reference", **ENGINE), ids)
    for a, b, want in zip(per_expert, stacked, expected):
        assert torch.equal(a, b)
        assert (a - want).abs().max().item() < 1e-4


# -- tensor and pipeline parallelism -----------------------------------------------------
@pytest.mark.parametrize("moe_backend", ["reference", pytest.param("fused", marks=[NO_FUSED])])
@pytest.mark.parametrize("tp,pp,ep", [(2, 1, False), (2, 1, True), (1, 2, False)], ids=["tp2", "ep2", "pp2"])
def test_two_ranks_give_the_tokens_of_one(hf_reference, tp, pp, ep, moe_backend):
    """Qwen2-MoE (dense and sparse layers, a shared expert, q/k/v bias) over two ranks. TP: each
    expert's intermediate dimension split like the dense MLP's, router replicated. EP: 5 of the
    10 experts whole on each rank, the shared expert split as TP splits it. PP: each stage loads
    and prepares its own layers' experts."""
    path, ids, expected, _ = hf_reference["qwen2_moe"]
    llm = LLM(path, moe_backend=moe_backend, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=1,
              enable_expert_parallel=ep, max_model_len=256, **ENGINE)
    try:
        outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected  # what one rank gives (the tests above)
        assert llm.engine.allocator.num_free_blocks() == llm.engine.allocator.num_blocks
    finally:
        llm.engine.shutdown()


def test_expert_parallel_splits_an_odd_expert_count_unevenly(checkpoint_dir):
    """Qwen3-MoE with 7 experts over 2 ranks: rank 0 holds experts 0-3, rank 1 experts 4-6
    (transformers 5's fused 3-D expert tensors are split per expert, then per rank); the tokens
    are transformers' and the per-expert load counts every expert once per routed token."""
    path = checkpoint_dir("qwen3_moe", num_experts=7)
    ids, expected, _ = greedy_and_logits(path, PROMPTS, MAX_NEW)
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, num_threads=1, max_model_len=256, **ENGINE)
    try:
        outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        load = llm.engine.stats()["expert_tokens"]
        assert sorted(load) == [1, 2, 3] and all(len(per_layer) == 7 for per_layer in load.values())
        assert len({sum(per_layer) for per_layer in load.values()}) == 1  # every sparse layer saw every token
        assert all(sum(per_layer[:4]) and sum(per_layer[4:]) for per_layer in load.values())  # both ranks' experts
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("num_experts,ranks,shares", [
    (8, 2, [(0, 4), (4, 4)]), (7, 2, [(0, 4), (4, 3)]), (10, 4, [(0, 3), (3, 3), (6, 2), (8, 2)]),
    (3, 3, [(0, 1), (1, 1), (2, 1)])])
def test_expert_shares_cover_every_expert_once(num_experts, ranks, shares):
    assert [expert_share(num_experts, r, ranks) for r in range(ranks)] == shares


def test_expert_parallel_refuses_fewer_experts_than_ranks():
    with pytest.raises(ValueError, match="4 experts cannot be split over 8 ranks.*enable_expert_parallel: false"):
        expert_share(4, 0, 8)


# -- routing in bfloat16 -----------------------------------------------------------------
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_in_bfloat16_is_transformers_routing(arch):
    """The float32 tests can't tell a float32 softmax from one in the compute dtype, or see the
    Qwen models' cast of the weights: transformers' own router, in bfloat16, on the same logits."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from modserve.plugins.models.moe import route

    router_cls = {"mixtral": MixtralTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter}[arch]
    num_experts, top_k = 8, 3
    config = AutoConfig.for_model(arch, hidden_size=32, num_local_experts=num_experts, num_experts=num_experts,
                                  num_experts_per_tok=top_k, norm_topk_prob=arch != "qwen2_moe")
    gen = torch.Generator().manual_seed(0)
    hf = router_cls(config).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(num_experts, 32, generator=gen) * 0.3)
    x = torch.randn(64, 32, generator=gen).to(torch.bfloat16)  # [T, hidden]
    _, want_weights, want_ids = hf(x)
    renormalize = arch != "qwen2_moe"
    ids, weights = route(torch.nn.functional.linear(x, hf.weight), top_k, renormalize,
                         torch.bfloat16 if arch != "mixtral" else None)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights.float())


# -- quantized experts ---------------------------------------------------------------------
@NO_FUSED
def test_int8_quantizes_each_expert_and_keeps_the_router_float(hf_reference):
    """Experts are ordinary Linears: the quantizer takes each one; router and shared-expert gate
    stay float (every rank, and every backend, must pick the same experts)."""
    from modserve.api import Unquantized

    path, ids, _, _ = hf_reference["qwen2_moe"]
    runs = {}
    for backend in ("reference", "fused"):
        llm = LLM(path, moe_backend=backend, quantization="int8", **ENGINE)
        block = llm.engine.runner.model.layers[1].mlp
        assert all(isinstance(lin.quantizer, Unquantized) for lin in (block.gate, block.shared_expert_gate))
        assert not any(isinstance(lin.quantizer, Unquantized) for lin in [*block.experts.gate_up, *block.experts.down])
        outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        runs[backend] = [o.outputs[0].token_ids for o in outs]
    assert runs["reference"] == runs["fused"]


@pytest.mark.parametrize("arch,method", [("qwen2_moe", "gptq"), ("mixtral", "awq")])
def test_a_pre_quantized_moe_checkpoint_is_the_float_model_with_its_dequantized_experts(hf_reference, arch, method):
    """AWQ and GPTQ checkpoints of MoE models (every expert's gate/up/down packed as AutoAWQ and
    GPTQModel write them, Mixtral's as w1/w3/w2, the routers float): each expert loads into its
    quantized Linear, and the model is the float one with each layer's dequantized weight in it."""
    from modserve.api import Linear, Unquantized
    from modserve.testing import cached_quantized_checkpoint

    float_path, ids, _, _ = hf_reference[arch]
    # group size 16: Qwen2-MoE's shared expert is 48 wide
    quantized = LLM(cached_quantized_checkpoint(method, arch=arch, group_size=16), quantization=method, **ENGINE)
    patched = LLM(float_path, **ENGINE)
    q_linears = dict(quantized.engine.runner.model.named_modules())
    swapped = 0
    with torch.no_grad():
        for name, linear in patched.engine.runner.model.named_modules():
            q = q_linears[name]
            if isinstance(linear, Linear) and not isinstance(q.quantizer, Unquantized):
                dequantized = q.quantizer.dequantize(q)
                # each expert's weights where its float ones are (4-bit rounding aside): a gate/up
                # or expert mix-up would be as far off as the weights themselves
                error = ((dequantized - linear.weight).norm() / linear.weight.norm()).item()
                assert error < 0.2, f"{name}: relative error {error:.3f}"
                linear.weight.copy_(dequantized)
                swapped += 1
    block = quantized.engine.runner.model.layers[1].mlp
    assert isinstance(block.gate.quantizer, Unquantized)  # the router stays float
    # quantized Linears: qkv and o in every layer; Qwen2-MoE's 2 dense MLPs (gate_up, down) and
    # 2 sparse layers of 10 experts and a shared one; Mixtral's 3 layers of 8 experts
    assert swapped == {"qwen2_moe": 4 * 2 + 2 * 2 + 2 * (10 + 1) * 2, "mixtral": 3 * 2 + 3 * 8 * 2}[arch]
    for got, want in zip(prefill_logits(quantized, ids), prefill_logits(patched, ids)):
        assert (got - want).abs().max().item() < 1e-4
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in quantized.generate(ids, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in patched.generate(ids, greedy, use_tqdm=False)]
