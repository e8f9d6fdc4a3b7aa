"""Attention steps for the kit: a few sequences over random block tables, fed step by step,
and the attention each step should produce, computed in float64 from the keys and values fed.

The cache's layout inside a block is the backend's own, so the kit never writes the cache
itself: every key and value reaches it through ``forward``, and later steps read it back (a
backend that does not store them, or stores them where it cannot find them, fails there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from modserve.api import FP8, AttentionMetadata, AttentionSpec, build_batch, to_fp8

CPU = torch.device("cpu")
K_SCALE, V_SCALE = 0.02, 0.03  # fp8 cache scales: randn / 0.02 stays well inside e4m3's 448
SPARE_BLOCKS = 4  # never in a block table: a backend must leave them alone


@dataclass(frozen=True)
class AttentionCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    fp8_kv: bool = False

    @property
    def id(self) -> str:
        h, hkv = self.num_heads, self.num_kv_heads
        heads = "mha" if h == hkv else "mqa" if hkv == 1 else "gqa"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{heads}{h}x{hkv}-d{self.head_dim}-bs{self.block_size}-{dtype}" + ("-fp8kv" if self.fp8_kv else "")

    def spec(self) -> AttentionSpec:
        return AttentionSpec(num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, scale=1 / math.sqrt(self.head_dim),
                             block_size=self.block_size, dtype=self.dtype, device=CPU,
                             kv_cache_dtype=FP8 if self.fp8_kv else None,
                             k_scale=K_SCALE if self.fp8_kv else 1.0, v_scale=V_SCALE if self.fp8_kv else 1.0)


def chunks_per_step(block_size: int) -> list[list[int]]:
    """Per sequence, the tokens it computes at each step (0: not yet arrived)."""
    bs = block_size
    return [
        [bs + 5, 1, 1],  # a prefill across a block boundary, then decodes
        [3, bs, 2],  # chunked prefill: bs new tokens over 3 cached ones, crossing a boundary
        [bs - 1, 1, 1],  # decodes onto the block boundary and past it
        [1, 1, 1],  # a one-token prompt, then decodes
        [2 * bs, 7],  # a block-aligned prefill, then a chunk starting a new block
        [0, 9, 1],  # arrives at step 1: a fresh prefill beside decodes and chunks
        [0, 0, 2 * bs + 3],  # arrives last: a long fresh prefill
    ]


@dataclass
class Step:
    index: int
    order: list[int]  # the batch's sequences, in batch order
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    meta: AttentionMetadata

    def describe(self, i: int) -> str:
        """Batch entry ``i`` in words, for assertion messages."""
        ctx, n = self.meta.context_lens_cpu[i], self.meta.query_lens_cpu[i]
        what = "a decode" if n == 1 and ctx else "a fresh prefill" if ctx == 0 else "a chunked prefill"
        return f"sequence {self.order[i]} ({what}: {n} new tokens after {ctx} cached)"


@dataclass
class History:
    """Every sequence's keys and values so far and its block table; makes the steps."""

    case: AttentionCase
    seed: int
    spec: AttentionSpec = field(init=False)
    gen: torch.Generator = field(init=False)
    plan: list[list[int]] = field(init=False)  # per sequence, its tokens at each step
    tables: list[list[int]] = field(init=False)  # per sequence, every block it will need
    spare: list[int] = field(init=False)  # the blocks no table holds
    keys: list[list[torch.Tensor]] = field(init=False)  # per sequence, [n, Hkv, D] per step
    values: list[list[torch.Tensor]] = field(init=False)
    num_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        self.spec = self.case.spec()
        self.gen = torch.Generator().manual_seed(self.seed)
        self.plan = chunks_per_step(self.case.block_size)
        needed = [-(-sum(p) // self.case.block_size) for p in self.plan]
        self.num_blocks = sum(needed) + SPARE_BLOCKS
        pool = torch.randperm(self.num_blocks, generator=self.gen).tolist()
        self.tables = [[pool.pop() for _ in range(n)] for n in needed]
        self.spare = pool
        self.keys = [[] for _ in self.plan]
        self.values = [[] for _ in self.plan]

    @property
    def num_steps(self) -> int:
        return max(len(p) for p in self.plan)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.case.dtype)

    def stale_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A cache full of random values: attending to a slot never written shows up."""
        noise = torch.randn(*shape, generator=self.gen) * 3
        return to_fp8(noise, 1.0) if self.case.fp8_kv else noise.to(self.case.dtype)

    def step(self, index: int) -> Step:
        c, bs = self.case, self.case.block_size
        active = [s for s, p in enumerate(self.plan) if index < len(p) and p[index]]
        order = [active[i] for i in torch.randperm(len(active), generator=self.gen).tolist()]  # any order
        new = [self.plan[s][index] for s in order]
        ctx = [sum(self.plan[s][:index]) for s in order]
        tables = [self.tables[s][: -(-(cl + n) // bs)] for s, cl, n in zip(order, ctx, new)]
        _, meta = build_batch([[0] * n for n in new], ctx, tables, bs, CPU)
        t = sum(new)
        q, k, v = self.rand(t, c.num_heads, c.head_dim), self.rand(t, c.num_kv_heads, c.head_dim), \
            self.rand(t, c.num_kv_heads, c.head_dim)
        for s, start, n in zip(order, meta.query_start_loc.tolist(), new):
            self.keys[s].append(k[start : start + n])
            self.values[s].append(v[start : start + n])
        return Step(index, order, q, k, v, meta)

    def decode_step(self, index: int) -> Step:
        """After steps ``0 .. index - 1``: one new token for every sequence that has arrived and
        has room left in its blocks, in batch order (a step of decodes only)."""
        c, bs = self.case, self.case.block_size
        order = [s for s, p in enumerate(self.plan)
                 if 0 < sum(p[:index]) < len(self.tables[s]) * bs]
        ctx = [sum(self.plan[s][:index]) for s in order]
        tables = [self.tables[s][: cl // bs + 1] for s, cl in zip(order, ctx)]
        _, meta = build_batch([[0]] * len(order), ctx, tables, bs, CPU)
        q, k, v = (self.rand(len(order), heads, c.head_dim) for heads in (c.num_heads, c.num_kv_heads, c.num_kv_heads))
        for row, s in enumerate(order):
            self.keys[s].append(k[row : row + 1])
            self.values[s].append(v[row : row + 1])
        return Step(index, order, q, k, v, meta)

    def stored(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` as the cache holds it, in float64: e4m3(x / scale) * scale for an fp8 cache."""
        return to_fp8(x, scale).double() * scale if self.case.fp8_kv else x.double()

    def reference(self, step: Step) -> torch.Tensor:  # [T, H, D] float64
        """Causal attention of every query row over its sequence's keys so far, in float64."""
        c, meta = self.case, step.meta
        group = c.num_heads // c.num_kv_heads
        out = torch.empty(step.q.shape, dtype=torch.float64)
        for i, s in enumerate(step.order):
            start, n, ctx = int(meta.query_start_loc[i]), meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            keys = self.stored(torch.cat(self.keys[s]), self.spec.k_scale).repeat_interleave(group, 1)  # [L, H, D]
            values = self.stored(torch.cat(self.values[s]), self.spec.v_scale).repeat_interleave(group, 1)
            q = step.q[start : start + n].double()  # [n, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(c.head_dim)  # [H, n, L]
            future = torch.arange(ctx + n)[None, :] > (ctx + torch.arange(n))[:, None]  # [n, L]
            probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
            out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, values)
        return out

    def written(self, step: Step) -> dict[int, torch.Tensor]:
        """Block -> the values this step stores there (keys and values, flattened, as stored)."""
        by_block: dict[int, list[torch.Tensor]] = {}
        spec = self.spec
        for t, slot in enumerate(step.meta.slot_mapping.tolist()):
            k, v = step.k[t], step.v[t]
            if self.case.fp8_kv:
                k, v = to_fp8(k, spec.k_scale), to_fp8(v, spec.v_scale)
            by_block.setdefault(slot // self.case.block_size, []).extend([k.flatten(), v.flatten()])
        return {b: torch.cat(parts) for b, parts in by_block.items()}
