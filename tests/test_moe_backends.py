"""The MoE backends against ``reference`` on synthetic experts: float, bfloat16, int8 and fp8
Linears; top-k 1 to 3; experts that get no tokens; ids outside ``[0, E)`` (which add nothing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from modserve.api import LinearFactory, Quantizer
from modserve.core.registry import get_registry
from modserve.plugins.moe.fused import FusedMoE, FusedMoEOptions
from modserve.plugins.moe.reference import ReferenceMoE
from modserve.quantizers.fp8 import FP8Weights
from modserve.quantizers.int8 import Int8

STACKED = FusedMoEOptions(stack="on")  # the GPU path (stacked weights, grouped GEMM), here on CPU tensors


class Experts(nn.Module):
    """What an MoE layer hands its backend: ``gate_up`` (gate then up) and ``down`` Linears."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)


def make_experts(num_experts: int, hidden: int, inter: int, quantizer: Quantizer | None = None,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> Experts:
    """Random experts loaded as a model's ``load_weights`` would: gate and up as two shards."""
    gen = torch.Generator().manual_seed(seed)
    make_linear = LinearFactory(quantizer, dtype, "cpu")
    gate_up, down = [], []
    for _ in range(num_experts):
        gu = make_linear(hidden, 2 * inter, shard_sizes=(inter, inter))
        for shard in (0, 1):
            gu.load("weight", (torch.randn(inter, hidden, generator=gen) / hidden**0.5).to(dtype), shard)
        d = make_linear(inter, hidden)
        d.load("weight", (torch.randn(hidden, inter, generator=gen) / inter**0.5).to(dtype))
        for lin in (gu, d):
            lin.quantizer.process_weights(lin)
        gate_up.append(gu)
        down.append(d)
    return Experts(gate_up, down)


def route(tokens: int, num_experts: int, k: int, seed: int = 0, unused: tuple[int, ...] = (),
          outside: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a random router: distinct ids per row, weights not renormalised (so none is 1);
    ``unused`` experts never chosen, and every third slot's id replaced by one of ``outside``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen)  # [T, E]
    logits[:, list(unused)] = float("-inf")
    weights, ids = torch.topk(logits.softmax(-1), k, dim=-1)  # [T, K] each
    if outside:
        flat = ids.view(-1)
        picks = torch.arange(0, flat.numel(), 3)
        flat[picks] = torch.tensor(outside)[torch.arange(len(picks)) % len(outside)]
    return ids, weights.float()


def run(backend, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: nn.Module,
        prepare: bool = True) -> torch.Tensor:
    if prepare:
        backend.prepare(experts)
    return backend.forward(x, ids, weights, experts)


def paths(experts: Experts) -> dict[str, Experts]:
    """The fused backend's three ways through the same experts: their Linears (never prepared),
    the stacked weights by a matmul per expert, and the stacked weights by one grouped GEMM."""
    FusedMoE(STACKED).prepare(experts)
    found = {"linears": experts}
    if hasattr(experts, "w13"):
        loop = Experts(list(experts.gate_up), list(experts.down))
        loop.w13, loop.w2, loop.use_grouped_mm = experts.w13, experts.w2, False
        found["stacked-loop"] = loop
        if experts.use_grouped_mm:
            found["grouped-mm"] = experts
    return found


def forward_all(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    found = {}
    for name, e in paths(experts).items():
        if name == "linears":  # the Linears of prepared experts, as an unprepared layer runs them
            e = Experts(list(e.gate_up), list(e.down))
        found[name] = FusedMoE().forward(x, ids, weights, e)
    return found


CASES = [  # (E, K, T, hidden, intermediate, unused experts)
    (5, 1, 1, 24, 40, ()),
    (5, 2, 7, 24, 40, (1,)),
    (5, 3, 33, 40, 24, (0, 4)),
    (8, 1, 100, 48, 72, (2, 3, 5)),
    (8, 2, 64, 48, 72, ()),
    (8, 3, 97, 56, 36, (7,)),
]


@pytest.mark.parametrize("num_experts,k,tokens,hidden,inter,unused", CASES)
def test_fused_matches_reference_in_float32(num_experts, k, tokens, hidden, inter, unused):
    experts = make_experts(num_experts, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    ids, weights = route(tokens, num_experts, k, seed=tokens, unused=unused)
    want = ReferenceMoE().forward(x, ids, weights, experts)
    got = forward_all(experts, x, ids, weights)
    assert {"linears", "stacked-loop"} <= set(got)
    for name, y in got.items():
        assert y.dtype == torch.float32 and y.shape == x.shape
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("outside", [(-1,), (5,), (5, 9, -1, -7)])
def test_ids_outside_the_experts_add_nothing(outside):
    num_experts, k, tokens, hidden = 5, 3, 30, 24
    experts = make_experts(num_experts, hidden, 40)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    ids, weights = route(tokens, num_experts, k, seed=3, outside=outside)
    inside = (ids >= 0) & (ids < num_experts)
    # the same sum with the outsiders' slots sent to expert 0 with weight 0
    want = ReferenceMoE().forward(x, ids.where(inside, 0), weights.where(inside, 0.0), experts)
    for name, y in forward_all(experts, x, ids, weights).items():
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=name)
    # a row whose every slot is outside comes back zero
    ids[0] = torch.tensor([num_experts, -1, num_experts + 2])
    for name, y in forward_all(experts, x[:1], ids[:1], weights[:1]).items():
        assert torch.equal(y, torch.zeros_like(x[:1])), name


def test_fused_matches_reference_in_bfloat16():
    num_experts, k, tokens, hidden = 8, 2, 50, 48
    experts = make_experts(num_experts, hidden, 72, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    ids, weights = route(tokens, num_experts, k, seed=5, unused=(6,))
    want = ReferenceMoE().forward(x, ids, weights, experts).float()
    for name, y in forward_all(experts, x, ids, weights).items():
        assert y.dtype == torch.bfloat16, name
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("make_quantizer", [Int8, FP8Weights], ids=["int8", "fp8"])
def test_fused_matches_reference_on_quantized_experts(make_quantizer):
    num_experts, k, tokens, hidden = 5, 2, 40, 64
    experts = make_experts(num_experts, hidden, 48, quantizer=make_quantizer())
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(6))
    ids, weights = route(tokens, num_experts, k, seed=7, unused=(2,), outside=(num_experts,))
    want = ReferenceMoE().forward(x, ids, weights, experts)
    backend = FusedMoE(STACKED)
    backend.prepare(experts)
    assert not hasattr(experts, "w13"), "quantized experts are not stacked"
    got = backend.forward(x, ids, weights, experts)
    # fp8 quantizes the activations per token: the same rows give the same scales either way
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_prepare_keeps_one_copy_of_the_weights():
    experts = make_experts(5, 24, 40)
    before = [lin.weight.clone() for lin in experts.gate_up]
    FusedMoE(STACKED).prepare(experts)
    assert experts.w13.shape == (5, 80, 24) and experts.w2.shape == (5, 24, 40)
    for e, lin in enumerate(experts.gate_up):
        assert lin.weight.untyped_storage().data_ptr() == experts.w13.untyped_storage().data_ptr()
        assert torch.equal(lin.weight, before[e])
    assert all(d.weight.untyped_storage().data_ptr() == experts.w2.untyped_storage().data_ptr()
               for d in experts.down)
    # what a reload writes into a Linear lands in the stack the forward reads
    with torch.no_grad():
        experts.down[3].weight.mul_(2)
    assert torch.equal(experts.w2[3], experts.down[3].weight)


def test_no_tokens():
    experts = make_experts(5, 24, 40)
    x = torch.randn(0, 24)
    ids, weights = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    assert run(FusedMoE(), x, ids, weights, experts).shape == (0, 24)


@pytest.mark.parametrize("name", ["reference", "fused", "triton"])
def test_registered(name):
    from modserve.api import MoEBackend

    assert issubclass(get_registry().load("moe_backend", name), MoEBackend)


# -- triton: the fused-MoE GEMM (under the interpreter on CPU) ---------------------------------
def triton_backend(**options):
    pytest.importorskip("triton")
    from modserve.plugins.moe.triton_moe import TritonMoE, TritonMoEOptions

    return TritonMoE(TritonMoEOptions(**options))


def test_align_pads_each_expert_to_whole_blocks_and_drops_outsiders():
    from modserve.plugins.moe.triton_moe import align

    ids = torch.tensor([[0, 2], [2, 4], [5, -1], [0, 2]])  # T=4, K=2, E=5; assignment id = t*K + k
    sorted_ids, block_expert = align(ids, 5, 16)
    pad = ids.numel()
    assert sorted_ids.shape == (96,)  # (8 + 5 * 15) rounded up to 16s
    assert sorted_ids[:16].tolist() == [0, 6] + [pad] * 14  # expert 0: rows (0, 0), (3, 0)
    assert sorted_ids[16:32].tolist() == [1, 2, 7] + [pad] * 13  # expert 2, in row order
    assert sorted_ids[32:48].tolist() == [3] + [pad] * 15  # expert 4
    assert (sorted_ids[48:] == pad).all()  # 4 and 5 (outsiders) nowhere
    assert block_expert.tolist() == [0, 2, 4, -1, -1, -1]


@pytest.mark.parametrize("num_experts,k,tokens,hidden,inter,unused", CASES)
def test_triton_matches_reference_in_float32(num_experts, k, tokens, hidden, inter, unused):
    experts = make_experts(num_experts, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    ids, weights = route(tokens, num_experts, k, seed=tokens, unused=unused, outside=(num_experts, -1))
    want = ReferenceMoE().forward(x, ids, weights, experts)
    got = run(triton_backend(block_n=32), x, ids, weights, experts)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_triton_matches_reference_in_bfloat16():
    num_experts, k, tokens, hidden = 8, 2, 50, 48
    experts = make_experts(num_experts, hidden, 72, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).bfloat16()
    ids, weights = route(tokens, num_experts, k, seed=5, unused=(6,), outside=(8,))
    want = ReferenceMoE().forward(x, ids, weights, experts).float()
    got = run(triton_backend(), x, ids, weights, experts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_triton_runs_quantized_experts_through_the_fused_path():
    experts = make_experts(5, 64, 48, quantizer=Int8())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    ids, weights = route(9, 5, 2, seed=7)
    want = ReferenceMoE().forward(x, ids, weights, experts)
    torch.testing.assert_close(run(triton_backend(), x, ids, weights, experts), want, rtol=1e-5, atol=1e-5)


def test_triton_refuses_unprepared_float_experts():
    experts = make_experts(5, 24, 40)
    ids, weights = route(3, 5, 2)
    with pytest.raises(ValueError, match="prepare"):
        triton_backend().forward(torch.randn(3, 24), ids, weights, experts)


def test_triton_refuses_cpu_without_the_interpreter(monkeypatch):
    backend = triton_backend()
    monkeypatch.setattr(backend.kernels, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backend.prepare(make_experts(5, 24, 40))


def test_triton_options_are_powers_of_two():
    from modserve.plugins.moe.triton_moe import TritonMoEOptions

    with pytest.raises(ValueError, match="power of two"):
        TritonMoEOptions(block_m=24)


class DoublingRanks:
    """A stand-in for two tensor-parallel ranks that hold the same partial sums: all-reduce doubles."""

    size = 2

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(2)


@pytest.mark.parametrize("backend", ["fused", "fused-unprepared", "triton"])
def test_row_parallel_down_is_summed_over_the_ranks(backend):
    """Under tensor parallelism ``down`` is row-parallel: the reference all-reduces every expert's
    output (inside the Linear); a stacked path must all-reduce its sum once."""
    experts = make_experts(5, 24, 40)
    ranks = DoublingRanks()
    for d in experts.down:
        d.spec, d.tp = dataclasses.replace(d.spec, parallel="row"), ranks
    x = torch.randn(12, 24, generator=torch.Generator().manual_seed(8))
    ids, weights = route(12, 5, 2, seed=9)
    want = ReferenceMoE().forward(x, ids, weights, experts)
    ranks.calls = 0
    made = triton_backend() if backend == "triton" else FusedMoE(STACKED)
    got = run(made, x, ids, weights, experts, prepare=backend != "fused-unprepared")
    assert ranks.calls == (len(ids.unique()) if backend == "fused-unprepared" else 1)  # once per expert called
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())



def test_experts_on_a_cpu_are_not_stacked_unless_asked():
    """auto keeps CPU experts as their Linears (the platform's GEMMs are faster there); off never stacks."""
    for options in (None, FusedMoEOptions(stack="off")):
        experts = make_experts(5, 24, 40)
        FusedMoE(options).prepare(experts)
        assert not hasattr(experts, "w13")
