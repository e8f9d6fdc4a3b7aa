"""A plugin module for tests/test_executor_mp.py: the ``paged`` attention backend under
another name, which raises on rank 0 only (the engine's process) once a sequence reaches
``FAULT_AT`` tokens. Its worker, running the same layer, then waits in the row-parallel
all-reduce that rank 0 never reaches."""

from __future__ import annotations

import torch.distributed as dist

from modserve.api import Register, hookimpl
from modserve.attention_backends.paged import PagedAttention

NAME = "rank0_faulty"
FAULT_AT = 40  # tokens


class Rank0Faulty(PagedAttention):
    def forward(self, q, k, v, kv_cache, meta, state):
        if dist.is_initialized() and dist.get_rank() == 0 and meta.max_seq_len >= FAULT_AT:
            raise RuntimeError("a planted fault, on rank 0 only")
        return super().forward(q, k, v, kv_cache, meta, state)


@hookimpl
def register_attention_backends(register: Register) -> None:
    register(NAME, f"{__name__}:Rank0Faulty", description="tests: paged, failing on rank 0 only")
