"""Built-in attention backends, registered like any plugin's (imports nothing heavy)."""

from __future__ import annotations

from pathlib import Path

from modserve.api import hookimpl

# The paged backend's C++ decode kernel: named here, away from torch, for the demo's start plan.
DECODE_KERNEL = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@hookimpl
def register_attention_backends(register):
    register(
        "reference",
        "modserve.attention_backends.reference:ReferenceAttention",
        description="Per-sequence SDPA over KV gathered from the cache; slow, for testing",
    )
    register(
        "paged",
        "modserve.attention_backends.paged:PagedAttention",
        options="modserve.attention_backends.paged:PagedOptions",
        description="Batched decode (a C++ kernel on CPU) plus per-sequence SDPA prefill over a paged KV "
        "cache (CPU default)",
    )
    register(
        "triton",
        "modserve.attention_backends.triton_attention:TritonAttention",
        options="modserve.attention_backends.triton_attention:TritonOptions",
        description="One Triton kernel over the paged cache for mixed prefill+decode batches, split-KV decode, "
        "CUDA-graph capturable decode (GPU; on CPU only under TRITON_INTERPRET=1, for tests)",
    )
