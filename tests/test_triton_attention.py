"""attention_backend: triton against reference: op-level on ragged mixed batches, the CUDA-graph
promise for decode steps, and greedy tokens through the engine.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports them): slow, so the shapes are small.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="attention_backend: triton needs the triton package")

from test_attention import MIXED, Case, make_case  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.api import AttentionBackend, AttentionMetadata, CudaGraphSupport  # noqa: E402
from modserve.api.fp8 import FP8, to_fp8  # noqa: E402
from modserve.attention_backends.reference import ReferenceAttention  # noqa: E402
from modserve.attention_backends.triton_attention import (  # noqa: E402
    TritonAttention, TritonAttentionState, TritonOptions)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (rtol, atol) against reference, which rounds differently in half precision (it dequantizes,
# then runs SDPA in that dtype): a few units in the last place.
TOL = {F32: (0, 1e-5), F16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}
# MIXED (decodes, fresh and chunked prefills, a one-token prompt) plus chunks crossing a
# 32-token block, a 40-token fresh prefill and a 20-token chunk: several query blocks each.
RAGGED = MIXED + [(29, 9), (0, 40), (45, 20)]
LONG_DECODES = [(300, 1), (173, 1), (0, 1), (257, 1), (64, 1), (31, 1)]  # 1 to 5 tiles of 64 keys


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: extra intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fp8_cache(case: Case, k_scale: float, v_scale: float) -> torch.Tensor:
    """The case's cache (default layout) as an fp8 cache with these scales holds it."""
    s = case.spec
    blocks = case.slots.view(2, -1, s.block_size, s.num_kv_heads, s.head_dim)  # [2, N, bs, Hkv, D]
    return torch.stack([to_fp8(blocks[0], k_scale), to_fp8(blocks[1], v_scale)])


def run(backend: AttentionBackend, case: Case, cache: torch.Tensor) -> torch.Tensor:  # [T, H, D]
    """One forward of the case on ``cache`` (changed in place)."""
    out = backend.forward(case.q, case.k, case.v, cache, case.meta, backend.prepare(case.meta))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return out


def compare(case: Case, options: TritonOptions | None = None, *,
            fp8_scales: tuple[float, float] | None = None) -> TritonAttentionState:
    """triton and reference on copies of one cache: outputs within float error, caches bit-equal."""
    spec = case.spec
    if fp8_scales is None:
        cache = case.slots.view(2, -1, spec.block_size, spec.num_kv_heads, spec.head_dim).clone()
    else:
        spec = dataclasses.replace(spec, kv_cache_dtype=FP8)
        cache = fp8_cache(case, *fp8_scales)
    ref, tri = ReferenceAttention(dataclasses.replace(spec)), TritonAttention(dataclasses.replace(spec), options)
    assert tri.kv_cache_problem() is None and tuple(cache.shape) == tri.kv_cache_shape(cache.shape[1])
    if fp8_scales is not None:  # as the core does once the checkpoint's scales are read: after __init__
        for b in (ref, tri):
            b.spec.k_scale, b.spec.v_scale = fp8_scales
    ref_cache, tri_cache = cache.clone(), cache.clone()
    expected = run(ref, case, ref_cache)
    state = tri.prepare(case.meta)
    got = tri.forward(case.q, case.k, case.v, tri_cache, case.meta, state)
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    rtol, atol = TOL[spec.dtype]
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=atol)
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "the caches differ after write"
    return state


def test_runs_under_the_interpreter_without_a_gpu() -> None:
    from modserve.attention_backends import triton_kernels

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must set TRITON_INTERPRET=1 without a GPU"
        assert triton_kernels.interpreted()


@pytest.mark.parametrize("heads,head_dim,block_size,dtype,block_m", [
    ((8, 8), 64, 16, F32, 64),  # MHA: G = 1, 64 query tokens per program
    ((8, 4), 64, 32, F32, 16),  # G = 2, 8 tokens per program: prefills span several
    ((8, 2), 128, 16, F32, 64),  # G = 4
    ((8, 1), 64, 32, F32, 64),  # MQA: G = 8
    ((6, 2), 80, 16, F32, 32),  # G = 3 padded to 4, D = 80 padded to 128
    ((4, 1), 96, 32, F16, 64),  # MQA, D = 96
    ((8, 2), 128, 32, F16, 64),
    ((8, 2), 64, 16, BF16, 64),
], ids=["mha-d64-bs16", "g2-d64-bs32-bm16", "g4-d128-bs16", "mqa8-d64-bs32", "g3-d80-bs16", "mqa4-d96-f16",
        "g4-d128-f16", "g4-d64-bf16"])
def test_mixed_batch_matches_reference(heads: tuple[int, int], head_dim: int, block_size: int,
                                       dtype: torch.dtype, block_m: int) -> None:
    case = make_case(RAGGED, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     dtype=dtype, seed=head_dim + block_size)
    state = compare(case, TritonOptions(block_m=block_m))
    assert state.num_splits == 1


@pytest.mark.parametrize("seqs", [
    [(40, 1), (3, 1), (0, 1), (15, 1)],  # decodes only
    [(0, 9)],  # one fresh prefill
    [(0, 5), (0, 17), (12, 3)],  # prefills only
    [(31, 2), (7, 1)],  # two-token chunk (e.g. speculative verify) next to a decode
    [((i * 37) % 90, 1) for i in range(40)],  # many decodes
    [(12, 3), (10, 0), (5, 1)],  # a sequence with no new token this step
], ids=["decodes", "one-prefill", "prefills", "short-chunk", "many-decodes", "empty-seq"])
def test_batch_shapes(seqs: list[tuple[int, int]]) -> None:
    case = make_case(seqs, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, seed=len(seqs))
    compare(case)


def test_strided_qkv_views() -> None:
    """q/k/v as views of one fused projection output, as models produce them."""
    case = make_case(MIXED, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, seed=5)
    t, d = case.meta.num_tokens, case.spec.head_dim
    fused = torch.cat([case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1)], dim=1)
    q, k, v = (x.view(t, -1, d) for x in fused.split([8 * d, 2 * d, 2 * d], dim=1))
    assert not q.is_contiguous()
    compare(dataclasses.replace(case, q=q, k=k, v=v))


@pytest.mark.parametrize("heads,head_dim,block_size,dtype", [
    ((8, 2), 64, 16, F32),
    ((4, 1), 128, 32, BF16),
    ((6, 2), 80, 16, F16),
], ids=["g4-d64-f32", "mqa-d128-bf16", "g3-d80-f16"])
def test_fp8_cache_matches_reference(heads: tuple[int, int], head_dim: int, block_size: int,
                                     dtype: torch.dtype) -> None:
    """Same fp8 cache, scales set after __init__: same bytes written, same attention."""
    case = make_case(RAGGED, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                     dtype=dtype, seed=head_dim)
    compare(case, fp8_scales=(0.05, 0.03))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads,dtype,fp8", [((8, 2), F32, False), ((6, 2), BF16, True)],
                         ids=["g4-f32", "g3-bf16-fp8"])
def test_decode_splits(splits: int, heads: tuple[int, int], dtype: torch.dtype, fp8: bool) -> None:
    """Decodes of a few hundred tokens, their keys in one slice or three (some slices empty)."""
    case = make_case(LONG_DECODES, block_size=16, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                     dtype=dtype, seed=splits)
    state = compare(case, TritonOptions(decode_splits=splits), fp8_scales=(0.05, 0.03) if fp8 else None)
    assert state.num_splits == splits and (state.part_out is not None) == (splits > 1)


def with_padding(case: Case, num_padding: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode-only batch padded as a captured graph's: rows of seq_len 1 over block 0 writing
    to slot -1. (meta, q, k, v) with the padding rows appended."""
    m, p = case.meta, num_padding
    ones = torch.ones(p, dtype=torch.long)
    b = m.num_seqs + p
    meta = AttentionMetadata(
        num_tokens=b, positions=torch.cat([m.positions, 0 * ones]),
        slot_mapping=torch.cat([m.slot_mapping, -ones]), query_start_loc=torch.arange(b + 1),
        query_lens=torch.ones(b, dtype=torch.long), context_lens=torch.cat([m.context_lens, 0 * ones]),
        seq_lens=torch.cat([m.seq_lens, ones]),
        block_tables=torch.cat([m.block_tables, torch.zeros(p, m.block_tables.shape[1], dtype=torch.long)]),
        query_lens_cpu=[1] * b, seq_lens_cpu=m.seq_lens_cpu + [1] * p, context_lens_cpu=m.context_lens_cpu + [0] * p,
        max_query_len=1, max_seq_len=m.max_seq_len)
    gen = torch.Generator().manual_seed(p)
    q, k, v = (torch.cat([x, (torch.randn(p, *x.shape[1:], generator=gen) * 5).to(x.dtype)])
               for x in (case.q, case.k, case.v))
    return meta, q, k, v


def worst_case_host(meta: AttentionMetadata, max_model_len: int, block_size: int) -> AttentionMetadata:
    """``meta`` as a graph's capture sees it: the same tensor values, block tables as wide as
    ``max_model_len`` (the graph's static buffer), host lists at the worst case."""
    b = meta.num_seqs
    tables = torch.zeros(b, -(-max_model_len // block_size), dtype=meta.block_tables.dtype)
    tables[:, : meta.block_tables.shape[1]] = meta.block_tables
    return dataclasses.replace(meta, block_tables=tables, seq_lens_cpu=[max_model_len] * b,
                               context_lens_cpu=[max_model_len - 1] * b, query_lens_cpu=[1] * b,
                               max_seq_len=max_model_len)


def test_padding_rows_write_nowhere() -> None:
    case = make_case(LONG_DECODES[:4], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, seed=2,
                     spare_blocks=3)
    meta, q, k, v = with_padding(case, 3)
    s = case.spec
    backend = TritonAttention(s)
    cache = case.slots.view(2, -1, s.block_size, s.num_kv_heads, s.head_dim).clone()
    out = backend.forward(q, k, v, cache, meta, backend.prepare(meta))
    flat = cache.view(2, -1, s.num_kv_heads, s.head_dim)  # [2, slots, Hkv, D]
    real = case.meta.slot_mapping
    assert torch.equal(flat[0, real], case.k) and torch.equal(flat[1, real], case.v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[real] = False
    assert torch.equal(flat[:, untouched], case.slots[:, untouched]), "a padding row (slot -1) wrote to the cache"
    expected = run(ReferenceAttention(s), case, case.slots.view_as(cache).clone())
    torch.testing.assert_close(out[: case.meta.num_seqs], expected, rtol=0, atol=1e-5)
    assert torch.isfinite(out).all(), "padding rows read one finite key: their output must be finite too"


def launch_plan(state: TritonAttentionState) -> tuple:
    """What a captured graph fixes: the grids, tile sizes, split count and workspace shapes."""
    return state.grid, state.block_q, state.num_splits, None if state.part_out is None else state.part_out.shape


@pytest.mark.parametrize("splits,num_sms", [(None, 0), (3, 0), (None, 132)], ids=["auto-cpu", "split3", "auto-gpu"])
def test_graph_replay_promise(splits: int | None, num_sms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step prepared from host lists at the worst case (as at capture) launches the
    same work whatever the tensors hold, reads no tensor value on the host, and gives the real
    step's output (as a replay does). ``num_sms``: a GPU's SM count for the auto split count."""
    max_model_len = 1024
    case = make_case(LONG_DECODES[:5], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64, seed=4)
    meta, q, k, v = with_padding(case, 3)
    backend = TritonAttention(case.spec, TritonOptions(decode_splits=splits))
    backend.num_sms = num_sms
    captured = worst_case_host(meta, max_model_len, case.spec.block_size)

    def no_sync(*args, **kwargs):
        raise AssertionError("prepare read a tensor's value on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "__iter__"):
            patch.setattr(torch.Tensor, name, no_sync)
        state = backend.prepare(captured)
    other = make_case([(7, 1), (900, 1), (3, 1), (511, 1), (0, 1)], block_size=16, num_heads=8, num_kv_heads=2,
                      head_dim=64, seed=9)
    other_state = backend.prepare(worst_case_host(with_padding(other, 3)[0], max_model_len, 16))
    assert launch_plan(state) == launch_plan(other_state), "the launch plan depends on the tensors' values"
    # auto on a GPU: 2 * 132 SMs / (8 x 2 programs) = 17 wanted, capped at 4 (slices >= 4 tiles of 1024)
    want_splits = splits or (1 if num_sms == 0 else 4)
    assert state.num_splits == want_splits

    s = case.spec
    cache = case.slots.view(2, -1, s.block_size, s.num_kv_heads, s.head_dim)
    replayed_cache, eager_cache = cache.clone(), cache.clone()
    replayed = backend.forward(q, k, v, replayed_cache, captured, state)
    eager = backend.forward(q, k, v, eager_cache, meta, backend.prepare(meta))
    b = case.meta.num_seqs
    torch.testing.assert_close(replayed[:b], eager[:b], rtol=0, atol=1e-5)
    assert torch.equal(replayed_cache, eager_cache)
    expected = run(ReferenceAttention(s), case, cache.clone())
    torch.testing.assert_close(replayed[:b], expected, rtol=0, atol=1e-5)


def greedy_tokens(path: str, backend: str, kv_cache_dtype: str) -> tuple[list[list[int]], LLM]:
    """Several prompts of different lengths sharing prefixes, submitted together; prefix caching
    on, and a 24-token budget so the longer prompts are prefilled in chunks."""
    llm = LLM(path, attention_backend=backend, dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64,
              max_model_len=512, max_num_batched_tokens=24, progress=False,
              kv_allocator={"name": "paged", "options": {"enable_prefix_caching": True}})
    tok = llm.get_tokenizer()
    system = tok.encode("the model token cache batch queue layer " * 4)
    prompts = [system + tok.encode(" first"), tok.encode("hi"), system + tok.encode(" second question here"),
               system[:20] + tok.encode(" x y z"),
               tok.encode("a much longer prompt about nothing in particular at all, really nothing " * 2)]
    assert max(len(p) for p in prompts) > 24
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_greedy_tokens_match_reference(llama_dir: str, kv_cache_dtype: str) -> None:
    expected, _ = greedy_tokens(llama_dir, "reference", kv_cache_dtype)
    got, llm = greedy_tokens(llama_dir, "triton", kv_cache_dtype)
    assert isinstance(llm.engine.runner.attn, TritonAttention)
    assert llm.engine.stats()["allocator_prefix_hit_tokens"] > 0
    assert got == expected


def test_registered_with_its_options_and_graph_support() -> None:
    from modserve.core.registry import Registry

    import modserve.attention_backends as plugin

    reg = Registry()
    reg.add_plugin(plugin, "builtin-attention")
    assert reg.load("attention_backend", "triton") is TritonAttention
    assert TritonAttention.cuda_graphs == CudaGraphSupport.DECODE
    assert reg.get("attention_backend", "triton").validate_options({"decode_splits": 3}) == \
        TritonOptions(decode_splits=3)
    with pytest.raises(ValueError, match="power of two"):
        TritonOptions(tile_n=48)


def test_refuses_devices_it_cannot_run_on() -> None:
    case = make_case([(3, 1)], block_size=16, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="runs on cuda devices"):
        TritonAttention(dataclasses.replace(case.spec, device=torch.device("meta")))
    code = (
        "import torch\n"
        "from modserve.api import AttentionSpec\n"
        "from modserve.attention_backends.triton_attention import TritonAttention\n"
        "spec = AttentionSpec(1, 4, 2, 32, 0.1, 16, torch.float32, torch.device('cpu'))\n"
        "try:\n"
        "    TritonAttention(spec)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "runs on a cpu device only under the Triton interpreter: set TRITON_INTERPRET=1" in proc.stdout, \
        proc.stdout + proc.stderr
