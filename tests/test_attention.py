"""The built-in attention backends against a naive float64 implementation."""

from __future__ import annotations

import math
import subprocess
import sys
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import functools

from modserve.attention_backends.paged import PagedAttention, PagedAttentionState, PagedOptions, write_rows
from modserve.attention_backends.reference import ReferenceAttention
from modserve.core.contracts.attention_backend import AttentionBackend, AttentionMetadata, AttentionSpec

# "paged" decodes with its C++ kernel on a CPU in float32; "paged-torch" with torch ops
BACKENDS = {"reference": ReferenceAttention, "paged": PagedAttention,
            "paged-torch": functools.partial(PagedAttention, options=PagedOptions(cpu_kernel=False))}

# (context_len, query_len) per sequence.
MIXED = [
    (37, 1),  # decode
    (0, 13),  # fresh prefill
    (100, 1),  # decode, long context
    (20, 7),  # chunked prefill: cached context plus new tokens
    (5, 1),  # decode, short context
    (0, 1),  # one-token prompt: a "decode" with nothing cached
    (16, 16),  # block-aligned chunked prefill
    (63, 1),  # decode ending on a block boundary (block_size 4 and 16)
]
HEADS = [(8, 2), (4, 4)]  # (num_heads, num_kv_heads): GQA and MHA


@pytest.fixture(autouse=True)
def _one_thread():
    """The tensors here are tiny: extra intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Case:
    spec: AttentionSpec
    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    slots: torch.Tensor  # [2, N * bs, Hkv, D] the cache by slot: context KV written, everything else stale
    ctx_k: list[torch.Tensor]  # per sequence [context_len, Hkv, D]
    ctx_v: list[torch.Tensor]


def make_case(
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    data_seed: int | None = None,
    spare_blocks: int = 7,
) -> Case:
    """A batch with each sequence's blocks scattered at random over a pool.

    Every cache slot not holding a sequence's context starts with random (stale)
    values, so a backend that attends to a slot it should not shows up. ``seed``
    draws the block tables, ``data_seed`` (default: ``seed``) the tensors.
    """
    g = torch.Generator().manual_seed(seed)
    ctx_lens = [c for c, _ in seqs]
    q_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)])

    def slot(i: int, pos: int) -> int:
        return int(tables[i, pos // block_size]) * block_size + pos % block_size

    gd = torch.Generator().manual_seed(seed if data_seed is None else data_seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gd).to(dtype)

    flat = rand(2, num_blocks * block_size, num_kv_heads, head_dim) * 3  # stale everywhere
    ctx_k, ctx_v = [], []
    for i, c in enumerate(ctx_lens):
        ck, cv = rand(c, num_kv_heads, head_dim), rand(c, num_kv_heads, head_dim)
        slots = torch.tensor([slot(i, p) for p in range(c)], dtype=torch.long)
        flat[0, slots], flat[1, slots] = ck, cv
        ctx_k.append(ck)
        ctx_v.append(cv)

    num_tokens = sum(q_lens)
    positions = torch.cat([torch.arange(c, s) for c, s in zip(ctx_lens, seq_lens)])
    slot_mapping = torch.tensor(
        [slot(i, p) for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)) for p in range(c, s)],
        dtype=torch.long,
    )
    query_lens = torch.tensor(q_lens, dtype=torch.long)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)]),
        query_lens=query_lens,
        context_lens=torch.tensor(ctx_lens, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        block_tables=tables,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=ctx_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    spec = AttentionSpec(
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scale=1.0 / math.sqrt(head_dim),
        block_size=block_size,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return Case(
        spec,
        meta,
        rand(num_tokens, num_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        flat,
        ctx_k,
        ctx_v,
    )


def naive_attention(case: Case) -> torch.Tensor:
    """Full attention per sequence over its explicitly concatenated K/V, in float64."""
    spec, meta = case.spec, case.meta
    group = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    start = 0
    for i, (c, n) in enumerate(zip(meta.context_lens_cpu, meta.query_lens_cpu)):
        q = case.q[start : start + n].double()  # [n, H, D]
        keys = torch.cat([case.ctx_k[i], case.k[start : start + n]]).double()  # [c+n, Hkv, D]
        values = torch.cat([case.ctx_v[i], case.v[start : start + n]]).double()
        for h in range(spec.num_heads):
            kh, vh = keys[:, h // group], values[:, h // group]  # [L, D]
            scores = q[:, h] @ kh.T * spec.scale  # [n, L]
            future = torch.arange(c + n)[None, :] > (c + torch.arange(n))[:, None]
            scores = scores.masked_fill(future, float("-inf"))
            out[start : start + n, h] = torch.softmax(scores, dim=-1) @ vh
        start += n
    return out


def slot_view(backend: AttentionBackend, cache: torch.Tensor) -> torch.Tensor:
    """A backend's cache (``kv_cache_shape`` layout) by slot: ``[2, slots, Hkv, D]`` (a copy for paged)."""
    s = backend.spec
    if isinstance(backend, PagedAttention):
        cache = cache.permute(0, 1, 3, 2, 4)  # [2, N, Hkv, bs, D] -> [2, N, bs, Hkv, D]
    return cache.reshape(2, -1, s.num_kv_heads, s.head_dim)


def backend_cache(backend: AttentionBackend, case: Case) -> torch.Tensor:
    """A fresh copy of the case's cache in the backend's layout; the inverse of ``slot_view``."""
    s = backend.spec
    blocks = case.slots.view(2, -1, s.block_size, s.num_kv_heads, s.head_dim)  # [2, N, bs, Hkv, D]
    if isinstance(backend, PagedAttention):
        blocks = blocks.permute(0, 1, 3, 2, 4)  # [2, N, Hkv, bs, D]
    cache = blocks.clone(memory_format=torch.contiguous_format)
    assert tuple(cache.shape) == backend.kv_cache_shape(blocks.shape[1])
    assert torch.equal(slot_view(backend, cache), case.slots)
    return cache


def run_backend(name: str, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache afterwards, by slot) of one forward on a copy of the case's cache."""
    backend = BACKENDS[name](case.spec)
    cache = backend_cache(backend, case)
    state = backend.prepare(case.meta)
    out = backend.forward(case.q, case.k, case.v, cache, case.meta, state)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return out, slot_view(backend, cache)


def check_cache(case: Case, flat: torch.Tensor) -> None:
    """New k/v sit at their slots; every other slot is untouched (``flat``: the cache by slot)."""
    before = case.slots
    sm = case.meta.slot_mapping
    torch.testing.assert_close(flat[0, sm], case.k, rtol=0, atol=0)
    torch.testing.assert_close(flat[1, sm], case.v, rtol=0, atol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[sm] = False
    torch.testing.assert_close(flat[:, untouched], before[:, untouched], rtol=0, atol=0)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_naive(backend: str, heads: tuple[int, int], block_size: int) -> None:
    case = make_case(MIXED, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1], seed=block_size)
    out, cache = run_backend(backend, case)
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=1e-5)
    check_cache(case, cache)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "seqs",
    [
        [(40, 1), (3, 1), (0, 1), (15, 1)],  # decodes only
        [(0, 9)],  # one fresh prefill
        [(0, 5), (0, 17), (12, 3)],  # prefills only
        [(31, 2), (7, 1)],  # two-token chunk (e.g. speculative verify) next to a decode
        [((i * 37) % 90, 1) for i in range(40)],  # > 16 decodes: length-sorted groups, scattered back
        [((i * 37) % 90, 1) for i in range(20)] + [(5, 7)],  # groups beside a prefill
    ],
    ids=["decodes", "one-prefill", "prefills", "short-chunk", "decode-groups", "decode-groups-mixed"],
)
def test_batch_shapes(backend: str, seqs: list[tuple[int, int]]) -> None:
    case = make_case(seqs, block_size=4, num_heads=8, num_kv_heads=2, seed=len(seqs))
    out, cache = run_backend(backend, case)
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=1e-5)
    check_cache(case, cache)


def test_backends_agree() -> None:
    case = make_case(MIXED * 2, block_size=16, num_heads=8, num_kv_heads=2, seed=3)
    ref, ref_cache = run_backend("reference", case)
    paged, paged_cache = run_backend("paged", case)
    torch.testing.assert_close(paged, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(paged_cache, ref_cache, rtol=0, atol=0)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_strided_qkv_views(backend: str) -> None:
    """q/k/v as views of one fused projection output, as models produce them."""
    case = make_case(MIXED, block_size=4, num_heads=8, num_kv_heads=2, seed=5)
    t, d = case.meta.num_tokens, case.spec.head_dim
    fused = torch.cat([case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1)], dim=1)
    q, k, v = fused.split([8 * d, 2 * d, 2 * d], dim=1)
    q, k, v = q.view(t, 8, d), k.view(t, 2, d), v.view(t, 2, d)
    assert not q.is_contiguous()
    attn = BACKENDS[backend](case.spec)
    cache = backend_cache(attn, case)
    out = attn.forward(q, k, v, cache, case.meta, attn.prepare(case.meta))
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=1e-5)
    check_cache(case, slot_view(attn, cache))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(backend: str, dtype: torch.dtype) -> None:
    case = make_case(MIXED, block_size=16, num_heads=8, num_kv_heads=2, dtype=dtype, seed=7)
    out, cache = run_backend(backend, case)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=5e-2)
    check_cache(case, cache)


def test_paged_state_shared_across_layers() -> None:
    """One prepare per step serves every layer (each with its own cache and k/v)."""
    case = make_case(MIXED, block_size=4, num_heads=8, num_kv_heads=2, seed=11)
    backend = PagedAttention(case.spec)
    state = backend.prepare(case.meta)
    assert isinstance(state, PagedAttentionState)
    assert state.num_decodes == 5 and not state.all_decodes
    assert [p.kv_rows is None for p in state.prefills] == [True, False, False]
    for layer in range(3):
        # Same layout (table seed), different data per layer.
        layer_case = make_case(
            MIXED, block_size=4, num_heads=8, num_kv_heads=2, seed=11, data_seed=100 + layer
        )
        assert torch.equal(layer_case.meta.block_tables, case.meta.block_tables)
        cache = backend_cache(backend, layer_case)
        out = backend.forward(layer_case.q, layer_case.k, layer_case.v, cache, case.meta, state)
        torch.testing.assert_close(out.double(), naive_attention(layer_case), rtol=0, atol=1e-5)
        check_cache(layer_case, slot_view(backend, cache))


@pytest.mark.parametrize("num_tokens", [1, 5, 16, 17, 300])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_write_rows_in_python_numpy_and_torch_agree(num_tokens: int, num_kv_heads: int, monkeypatch) -> None:
    """A step's cache rows, made in a Python list (a few), numpy (more) or torch ops (off the
    CPU), are the rows of slot s's token for each KV head: (block * Hkv + h) * bs + offset."""
    bs = 4
    slots = torch.randperm(4096, generator=torch.Generator().manual_seed(num_tokens))[:num_tokens]  # [T]
    expected = torch.tensor([(int(x) // bs * num_kv_heads + h) * bs + int(x) % bs
                             for x in slots for h in range(num_kv_heads)], dtype=torch.int64)
    assert torch.equal(write_rows(slots, bs, num_kv_heads), expected)
    with torch.inference_mode():
        assert torch.equal(write_rows(slots, bs, num_kv_heads), expected)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the torch ops' path (a compiled region's)
    assert torch.equal(write_rows(slots, bs, num_kv_heads), expected)


def test_paged_reused_across_steps() -> None:
    """One backend instance over steps of growing and shrinking size and changing dtype
    (the torch-ops path keeps scratch buffers between calls)."""
    backend = None
    steps = [MIXED, [(3, 1), (0, 4)], MIXED * 3, [(200, 1)] * 6, MIXED]
    for step, seqs in enumerate(steps):
        for dtype in (torch.float32, torch.bfloat16):
            case = make_case(seqs, block_size=4, num_heads=8, num_kv_heads=2, dtype=dtype, seed=20 + step)
            backend = backend or PagedAttention(case.spec, PagedOptions(cpu_kernel=False))
            state = backend.prepare(case.meta)
            out = backend.forward(case.q, case.k, case.v, backend_cache(backend, case), case.meta, state)
            atol = 1e-5 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=atol)


def test_paged_decodes_with_its_cpu_kernel_in_float32_only() -> None:
    case = make_case(MIXED, block_size=4, num_heads=8, num_kv_heads=2, seed=5)
    kernel = PagedAttention(case.spec)
    assert kernel.kernel, "the C++ decode kernel did not build here (see the warning logged)"
    state = kernel.prepare(case.meta)
    assert state.kernel_decodes is not None and not state.decode_groups
    bf16 = make_case(MIXED, block_size=4, num_heads=8, num_kv_heads=2, seed=5, dtype=torch.bfloat16)
    assert not PagedAttention(bf16.spec).kernel
    assert not PagedAttention(case.spec, PagedOptions(cpu_kernel=False)).kernel


@pytest.mark.parametrize("heads,head_dim,block_size,q_scale", [
    ((12, 4), 64, 16, 1.0),  # G = 3: the reference model's shape
    ((12, 4), 64, 16, 30.0),  # sharp softmax: most exponentials far below e^-87
    ((8, 1), 24, 16, 1.0),  # G = 8: two passes of 4 query rows; 24 = 16 + 8 dimensions
    ((6, 2), 40, 12, 1.0),  # 40 = 16 + 16 + 8; 12-token blocks: 8 keys at once, then 4 alone
    ((5, 5), 8, 8, 1.0),  # G = 1, one 8-float vector per head
], ids=["g3-d64", "g3-sharp", "g8-d24", "g3-d40-bs12", "g1-d8"])
def test_paged_cpu_kernel_shapes(heads, head_dim: int, block_size: int, q_scale: float) -> None:
    """The decode kernel's paths: 8 keys at a time and lone tail keys, query rows in passes
    of up to 4, 16- and 8-float slices of a head, every length from 1 to 3 blocks and more."""
    seqs = [((i * 53) % 200, 1) for i in range(13)]  # decodes only, 1 to 195 tokens each
    case = make_case(seqs, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, seed=head_dim)
    case.q.mul_(q_scale)
    assert PagedAttention(case.spec).kernel
    out, cache = run_backend("paged", case)
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=1e-5)
    check_cache(case, cache)


def kernel_widths() -> list[int]:
    """The decode kernel's vector widths this build has: 8 everywhere, 16 with AVX-512."""
    assert PagedAttention(make_case([(3, 1)], block_size=4, num_heads=2, num_kv_heads=1).spec).kernel
    return sorted({8, torch.ops.modserve_paged.vector_width()})


def test_paged_kernel_width_follows_the_cpu() -> None:
    """16-float vectors exactly where the CPU the kernel was built for has AVX-512; a width
    the build lacks is refused by name."""
    from modserve.plugins.platforms.cpu.features import parse_cpuinfo

    avx512 = parse_cpuinfo(Path("/proc/cpuinfo").read_text()).has("avx512f")
    assert kernel_widths() == ([8, 16] if avx512 else [8])
    case = make_case([(40, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=64)
    assert PagedAttention(case.spec).kernel_width == (16 if avx512 else 8)
    odd = make_case([(40, 1)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=40)
    assert PagedAttention(odd.spec).kernel_width == 8  # 40 floats are not whole 16-float vectors
    backend = PagedAttention(case.spec)
    cache = backend_cache(backend, case)
    with pytest.raises(RuntimeError, match="width 12: 0 \\(the widest\\), 8, or 16 in a build with AVX-512"):
        torch.ops.modserve_paged.decode(case.q, cache[0], cache[1], case.meta.block_tables, case.meta.seq_lens,
                                        case.spec.scale, width=12)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,head_dim,block_size", [
    ((12, 4), 64, 16),  # G = 3, the reference model's shape: one 64-float value pass at width 16
    ((8, 1), 128, 16),  # G = 8: two passes of 4 query rows by two of 64 dimensions
    ((6, 2), 80, 24),  # 80 = 64 + 16: a one-vector value pass; 24-token blocks: 16 keys, then 8 alone
    ((4, 4), 32, 8),  # G = 1 (keys read in place, not widened first); blocks shorter than 16 keys
], ids=["g3-d64", "g8-d128", "g3-d80-bs24", "g1-d32-bs8"])
def test_paged_cpu_kernel_at_each_width(heads, head_dim: int, block_size: int, cache_dtype) -> None:
    """Every vector width the build has (the 8-float path stays checked on an AVX-512
    machine) against float64 attention, over a float32 and a bf16 cache; the widths agree
    to float32 rounding (only the order of the sums differs)."""
    seqs = [((i * 53) % 230, 1) for i in range(13)]  # decodes only, 1 to 225 tokens each
    case = make_case(seqs, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
                     head_dim=head_dim, seed=head_dim)
    for t in (case.q, case.k, case.v, case.slots, *case.ctx_k, *case.ctx_v):
        t.copy_(t.to(cache_dtype).float())  # exactly representable in the cache
    backend = PagedAttention(dataclasses.replace(case.spec, kv_cache_dtype=cache_dtype))
    assert backend.kernel
    cache = backend_cache(backend, case).to(cache_dtype)
    backend.forward(case.q, case.k, case.v, cache, case.meta, backend.prepare(case.meta))  # writes k, v
    want = naive_attention(case)
    outs = []
    for width in kernel_widths():
        out = torch.ops.modserve_paged.decode(case.q, cache[0], cache[1], case.meta.block_tables,
                                              case.meta.seq_lens, case.spec.scale, width=width)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5, msg=lambda m: f"width {width}: {m}")
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)
    if len(outs) == 1:  # the 8-float path passed above
        pytest.skip("16-float path: this build has no AVX-512 (the kernel is built for the CPU it runs on)")


@pytest.mark.parametrize("bf16_prefill", ["off", "on"])
@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("seqs", [MIXED, [((i * 37) % 90, 1) for i in range(20)] + [(5, 7)]],
                         ids=["mixed", "decode-groups-mixed"])
def test_paged_reads_a_bf16_cache_under_float32_compute(cpu_kernel: bool, seqs, bf16_prefill: str) -> None:
    """The CPU's bf16_gemm route: float32 queries over a bf16 cache, written rounded and read
    widened, by the C++ kernel and by the torch path. With every query, key and value a bf16
    value already, a decode is float32 attention over exactly those values; so is a prefill
    with ``bf16_prefill`` off. On, a prefill attends in bf16 (torch's flash kernel): its
    probabilities and its output rounded to bf16, the sums in float32."""
    case = make_case(seqs, block_size=4, num_heads=8, num_kv_heads=2, seed=11)
    for t in (case.q, case.k, case.v, case.slots, *case.ctx_k, *case.ctx_v):
        t.copy_(t.bfloat16().float())
    spec = dataclasses.replace(case.spec, kv_cache_dtype=torch.bfloat16)
    backend = PagedAttention(spec, PagedOptions(cpu_kernel=cpu_kernel, bf16_prefill=bf16_prefill))
    assert backend.kv_cache_problem() is None and backend.kernel == cpu_kernel
    assert backend.bf16_prefill == (bf16_prefill == "on")
    cache = backend_cache(backend, case).bfloat16()
    out = backend.forward(case.q, case.k, case.v, cache, case.meta, backend.prepare(case.meta))
    assert cache.dtype == torch.bfloat16 and out.dtype == torch.float32
    lens = torch.tensor(case.meta.query_lens_cpu)
    prefill = lens.repeat_interleave(lens) > 1  # [T]: the rows of sequences with several new tokens
    assert prefill.any() and (~prefill).any()
    want = naive_attention(case)
    torch.testing.assert_close(out[~prefill].double(), want[~prefill], rtol=0, atol=1e-5)
    if bf16_prefill == "off":
        torch.testing.assert_close(out[prefill].double(), want[prefill], rtol=0, atol=1e-5)
    else:
        # a few bf16 steps (2^-8 each) of rounded probabilities and output
        torch.testing.assert_close(out[prefill].double(), want[prefill], rtol=2**-7, atol=4e-3)
        assert (out[prefill].double() - want[prefill]).abs().max() > 1e-5  # it did attend in bf16
    check_cache(case, slot_view(backend, cache).float())
    half = dataclasses.replace(case.spec, dtype=torch.float16, kv_cache_dtype=torch.bfloat16)
    assert "not torch.bfloat16 under torch.float16" in PagedAttention(half).kv_cache_problem()


def test_kernel_build_failure_falls_back_and_says_why(monkeypatch, caplog) -> None:
    from torch.utils import cpp_extension

    from modserve.plugins.platforms.cpu import kernels as cpu_kernels

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'modserve_paged_decode'\nc++: not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level("WARNING", logger="modserve"):
        problem = cpu_kernels.load_kernel.__wrapped__("modserve_paged_decode", "unused.cpp")
    assert problem == "RuntimeError: c++: not found"
    assert "C++ kernel modserve_paged_decode could not be built (RuntimeError: c++: not found); " \
        "using torch ops instead" in caplog.text


def test_paged_without_prepare() -> None:
    case = make_case(MIXED, block_size=4, num_heads=8, num_kv_heads=2, seed=13)
    backend = PagedAttention(case.spec)
    cache = backend_cache(backend, case)
    out = backend.forward(case.q, case.k, case.v, cache, case.meta, None)
    torch.testing.assert_close(out.double(), naive_attention(case), rtol=0, atol=1e-5)
    check_cache(case, slot_view(backend, cache))


def test_registration() -> None:
    from modserve.core.registry import Registry

    import modserve.attention_backends as plugin

    reg = Registry()
    reg.add_plugin(plugin, "builtin-attention")
    assert reg.names("attention_backend") == ["paged", "reference", "triton"]
    assert reg.load("attention_backend", "paged") is PagedAttention
    assert reg.load("attention_backend", "reference") is ReferenceAttention
    assert all(r.description for r in reg.registrations()["attention_backend"].values())


def test_registration_imports_nothing_heavy() -> None:
    code = (
        "import sys, modserve.attention_backends as m\n"
        "m.register_attention_backends(lambda *a, **k: None)\n"
        "heavy = [n for n in ('torch', 'modserve.attention_backends.paged',"
        " 'modserve.attention_backends.reference') if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
