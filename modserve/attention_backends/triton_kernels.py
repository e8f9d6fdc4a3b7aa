"""The Triton kernels of ``attention_backend: triton`` and their launchers.

Three kernels read and write the default paged cache in place (``[2, num_blocks, block_size,
Hkv, D]``, any strides but a contiguous head dimension):

- ``_write_kv_kernel``: one program per new token copies its ``[Hkv, D]`` keys and values to
  its slot. A slot < 0 (a padding row of a captured batch) masks every store.
- ``_unified_attention_kernel``: causal attention for any mixed batch. Grid
  ``(num_tokens // BLOCK_Q + num_seqs, Hkv)``; a program owns BLOCK_Q consecutive query tokens
  of one sequence times the G query heads of one KV head (see the kernel's docstring).
- ``_decode_split_kernel`` + ``_reduce_splits_kernel``: split-KV decode. Grid ``(num_seqs, Hkv,
  num_splits)``; each program attends one decode's G heads over one slice of its keys and
  writes a partial output with its row max and sum; the reduce combines the slices.

Both attention kernels share ``_attend_keys``, the loop over key tiles: TILE_N keys at a time,
each key's block looked up in the block table (``block_table[j // BLOCK_SIZE]``, offset
``j % BLOCK_SIZE``), so TILE_N and the block size are independent; an online softmax in
float32, in base 2 (``log2(e)`` is folded into the scale), with the running max starting at a
finite -1e30 so a row that sees no key in a tile never makes ``-inf - -inf``.

Everything here is ordinary GPU Triton. On CPU tensors it runs only under the interpreter,
chosen by ``triton.jit`` when this module is imported with ``TRITON_INTERPRET=1``; there, and
only there, bfloat16 is multiplied in float32 (``DOT_F32``: the interpreter's ``tl.dot`` cannot
multiply bfloat16), so the tests check that dtype's loads, conversions and stores, not its dot.

MASKS: a load or store mask is always a comparison of a tensor, never a scalar condition
``&``-ed with a tensor: the interpreter computes ``scalar_bool & tensor_bool`` in integers, and
since Triton 3.9 its ``tl.load`` refuses such a mask ("mask has unsupported dtype"). A scalar
condition goes into a bound instead (``h < tl.where(ok, NUM_KV_HEADS, 0)``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x * log2(e))
NEG_BIG = tl.constexpr(-1.0e30)  # the running max starts finite: exp2(m_old - m_new) is never NaN


@triton.jit
def _write_kv_kernel(
    k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # k, v [T, Hkv, D]
    stride_cb, stride_co, stride_ch,  # a cache half [num_blocks, block_size, Hkv, D]
    NUM_KV_HEADS: tl.constexpr, HEAD_D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # NOTE: -1 marks a padding row: it must write nowhere, so it has no heads to write. The
    # condition goes into the bound (see MASKS in the module docstring).
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    slot = tl.maximum(slot, 0)
    h = tl.arange(0, H_PAD)  # [H_PAD]
    d = tl.arange(0, D_PAD)  # [D_PAD]
    mask = (h < num_heads)[:, None] & (d < HEAD_D)[None, :]  # [H_PAD, D_PAD]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _attend_keys(
    acc, m_i, l_i,  # [M, D_PAD] float32, [M], [M]: the running output, max and sum
    q,  # [M, D_PAD] in the compute dtype
    pos,  # [M] each row's query position: it sees keys j <= pos
    k_cache_ptr, v_cache_ptr,  # offset to the KV head already
    block_table_ptr,  # this sequence's row of the block table
    kv_start, kv_end,  # keys kv_start .. kv_end - 1
    qk_scale,  # softmax scale * k_scale * log2(e)
    stride_cb, stride_co,
    BLOCK_SIZE: tl.constexpr, HEAD_D: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr,
    FP8: tl.constexpr,
):
    """Online softmax of ``q`` over keys ``kv_start .. kv_end - 1``, TILE_N at a time."""
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_D
    for start in range(kv_start, kv_end, TILE_N):
        j = start + tl.arange(0, TILE_N)  # [N] key positions
        j_ok = j < kv_end
        block = tl.load(block_table_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (j % BLOCK_SIZE) * stride_co  # [N]
        # NOTE: masked loads give 0, never the stale (or, in fp8, NaN) bytes past kv_end
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None],
                    other=0)  # [D_PAD, N]
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                    other=0)  # [N, D_PAD]
        if FP8:  # raw e4m3 bytes; every e4m3 value is exact in float16, bfloat16 and float32
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k = k.to(q.dtype)  # the dot's operand type (see DOT_F32); a no-op unless fp8 or DOT_F32
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision="ieee") * qk_scale  # [M, N], base-2 logits
        s = tl.where((j[None, :] <= pos[:, None]) & j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
        alpha = tl.exp2(m_i - m_new)  # [M] rescales what was summed so far
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` with ``query_start_loc[i] // BLOCK_Q + i <= pid`` (binary search).

    Sequence i's query blocks are numbered from ``query_start_loc[i] // BLOCK_Q + i``: that
    leaves each sequence at least ``ceil(query_len / BLOCK_Q)`` numbers before the next one's,
    so ``num_tokens // BLOCK_Q + num_seqs`` programs cover every block (extras return)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        right = first <= pid
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,  # [B, max_blocks], [B + 1] int32, [B] int32
    qk_scale, out_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,  # q, out [T, H, D]
    stride_cb, stride_co, stride_ch,  # a cache half [num_blocks, block_size, Hkv, D]
    stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr, FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Causal attention of BLOCK_Q query tokens of one sequence, for the G query heads of KV
    head ``program_id(1)``: ``BLOCK_M = BLOCK_Q * G_PAD`` rows, row m = (token m // G_PAD,
    head m % G_PAD), so each key tile is read once for the whole group. Query row r of a
    sequence sits at position ``context_len + r``; the program reads keys only up to the last
    one its rows can see."""
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = pid - (q_start // BLOCK_Q + seq)  # this program's query block within the sequence
    if local * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    m = tl.arange(0, BLOCK_M)
    r = local * BLOCK_Q + m // G_PAD  # [M] query row within the sequence
    g = m % G_PAD  # [M] query head within the group
    row_ok = (r < query_len) & (g < G)
    tok = (q_start + r).to(tl.int64)  # [M] row of q and out
    head = kv_head * G + g  # [M] query head: GQA maps head h to KV head h // G
    d = tl.arange(0, D_PAD)
    io_mask = row_ok[:, None] & (d < HEAD_D)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0)  # [M, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)

    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (local + 1) * BLOCK_Q)  # one past the last key seen
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, context_len + r,
        k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, 0, kv_end, qk_scale, stride_cb, stride_co,
        BLOCK_SIZE, HEAD_D, D_PAD, TILE_N, FP8,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * out_scale
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_split_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr,  # [B, H, S, D], [B, H, S], [B, H, S] float32
    q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_cb, stride_co, stride_ch, stride_bt,
    G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr, FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One decode's G query heads over one slice of its keys. The slice is whole tiles,
    ``ceil(ceil(seq_len / TILE_N) / num_splits)`` of them, computed here from the device's
    seq_len: the launch does not depend on it. A slice past the end writes an empty partial."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    has_row = tl.load(query_start_loc_ptr + seq + 1) > row  # a sequence with no new token: none
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
    kv_start = split * tiles_per_split * TILE_N
    kv_end = tl.minimum(seq_len, kv_start + tiles_per_split * TILE_N)

    g = tl.arange(0, M_PAD)  # [M] query head within the group (rows >= G are padding for tl.dot)
    g_ok = g < G
    head = kv_head * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_D
    q_heads = tl.where(has_row, G, 0)  # no new token: no query to load (see MASKS)
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=(g < q_heads)[:, None] & d_ok[None, :], other=0)  # [M, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)

    acc = tl.zeros((M_PAD, D_PAD), dtype=tl.float32)
    m_i = tl.full((M_PAD,), NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros((M_PAD,), dtype=tl.float32)
    pos = tl.zeros((M_PAD,), dtype=tl.int32) + (seq_len - 1)  # the decode sees all its keys
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, pos,
        k_cache_ptr + kv_head * stride_ch, v_cache_ptr + kv_head * stride_ch,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_start, kv_end, qk_scale, stride_cb, stride_co,
        BLOCK_SIZE, HEAD_D, D_PAD, TILE_N, FP8,
    )
    part = (seq.to(tl.int64) * tl.num_programs(1) * G + head) * num_splits + split  # [M] index in [B, H, S]
    tl.store(part_max_ptr + part, m_i, mask=g_ok)
    tl.store(part_sum_ptr + part, l_i, mask=g_ok)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty slice: 0, with weight l_i = 0
    tl.store(part_out_ptr + part[:, None] * HEAD_D + d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
    out_scale, num_splits,
    stride_ot, stride_oh,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s with w_s = l_s 2^(m_s - max m): the softmax over the
    whole row, from each slice's normalized output o_s, max m_s and sum l_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    has_row = tl.load(query_start_loc_ptr + seq + 1) > row
    s = tl.arange(0, S_PAD)
    s_ok = s < num_splits
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + s  # [S_PAD]
    m_s = tl.load(part_max_ptr + part, mask=s_ok, other=NEG_BIG)
    l_s = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    w = l_s * tl.exp2(m_s - tl.max(m_s, axis=0))  # [S_PAD]
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_D
    o_s = tl.load(part_out_ptr + part[:, None] * HEAD_D + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)  # [S_PAD, D_PAD]
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o_s, axis=0) / tl.where(total > 0, total, 1.0) * out_scale  # [D_PAD]
    out_d = tl.where(has_row, HEAD_D, 0)  # no new token: no row to write (see MASKS)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < out_d)


# ---------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------
def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D], the cache's dtype
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; < 0: write nothing
) -> None:
    """Store ``k``, ``v`` at their slots, in place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_D=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
    )


def unified_attention(
    out: torch.Tensor,  # [T, H, D], written
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (uint8 for an fp8 cache)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    *,
    grid: tuple[int, int],
    block_q: int,
    group: int,
    tile_n: int,
    qk_scale: float,
    out_scale: float,
    fp8: bool,
    num_warps: int = 4,
) -> None:
    head_dim = q.shape[2]
    _unified_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        qk_scale, out_scale, seq_lens.shape[0],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=group, G_PAD=triton.next_power_of_2(group), BLOCK_Q=block_q, BLOCK_SIZE=k_cache.shape[1],
        HEAD_D=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), TILE_N=tile_n, FP8=fp8,
        DOT_F32=_dot_f32(q), num_warps=num_warps,
    )


def split_decode_attention(
    out: torch.Tensor,  # [T, H, D], written at each decode's row
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (uint8 for an fp8 cache)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    part_out: torch.Tensor,  # [B, H, S, D] float32 workspace
    part_max: torch.Tensor,  # [B, H, S] float32 workspace
    part_sum: torch.Tensor,  # [B, H, S] float32 workspace
    *,
    group: int,
    tile_n: int,
    qk_scale: float,
    out_scale: float,
    fp8: bool,
    num_warps: int = 4,
) -> None:
    num_seqs, num_heads, num_splits, head_dim = part_out.shape
    d_pad = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(num_seqs, num_heads // group, num_splits)](
        part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        qk_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=group, M_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=k_cache.shape[1],
        HEAD_D=head_dim, D_PAD=d_pad, TILE_N=tile_n, FP8=fp8, DOT_F32=_dot_f32(q), num_warps=num_warps,
    )
    _reduce_splits_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum, query_start_loc, out_scale, num_splits,
        out.stride(0), out.stride(1),
        HEAD_D=head_dim, D_PAD=d_pad, S_PAD=triton.next_power_of_2(num_splits),
    )


@functools.cache
def interpreted() -> bool:
    """Whether these kernels were defined under the interpreter (run on CPU tensors only)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_unified_attention_kernel, InterpretedFunction)


def _dot_f32(q: torch.Tensor) -> bool:
    """Whether the attention kernels multiply in float32 rather than in q's dtype. Only for
    bfloat16 under the interpreter: it keeps bfloat16 as uint16 and its tl.dot multiplies those
    integers (Triton 3.7). On a GPU bfloat16 goes to the tensor cores as it is."""
    return q.dtype == torch.bfloat16 and interpreted()
