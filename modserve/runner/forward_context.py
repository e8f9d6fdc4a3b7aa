"""What a model's layers need for attention during one forward pass, out of band.

A model calls :func:`attention` with its tensors and its layer index; the backend, the
layer's KV cache and the step's metadata come from the context that the model's
``forward`` opens with :func:`forward_context`. Keeping them out of the layers'
arguments leaves a forward pass with only tensors in and out, which is what lets
torch.compile trace a layer (or more) as one graph: under compilation, attention is the
opaque custom op ``modserve::attention`` (inductor neither traces nor reorders the
plugin's Python), and everything between two attention calls is fused.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from modserve.core.contracts.attention_backend import AttentionBackend, AttentionMetadata
from modserve.core.plugin_calls import broke, described, failed


@dataclass(slots=True)
class ForwardContext:
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]  # one per layer
    meta: AttentionMetadata
    state: Any  # what backend.prepare(meta) built for this step


_local = threading.local()  # an engine thread and a test thread must not see each other's step


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                    state: Any) -> Iterator[None]:
    outer = getattr(_local, "context", None)  # restored on exit, so contexts nest
    _local.context = ForwardContext(backend, kv_caches, meta, state)
    try:
        yield
    finally:
        _local.context = outer


@contextlib.contextmanager
def after_each_layer(hook: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Call ``hook(layer, kv_cache)`` as each layer's attention has written its KV (a KV
    connector saves it from there). Eager forwards only: a CUDA graph would not replay it."""
    _local.after_layer = hook
    try:
        yield
    finally:
        _local.after_layer = None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    ctx: ForwardContext | None = getattr(_local, "context", None)
    if ctx is None:
        raise RuntimeError("attention() called outside forward_context(): the model's forward must open it")
    kv_cache = ctx.kv_caches[layer]
    try:  # NOTE: once per layer: a bare try and three compares, nothing read from the device
        out = ctx.backend.forward(q, k, v, kv_cache, ctx.meta, ctx.state)
    except Exception as e:
        raise failed(ctx.backend, "attention_backend", "forward()", e) from e
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
        raise broke(ctx.backend, "attention_backend", "forward()", f"a tensor of q's shape {list(q.shape)} "
                    f"and dtype {str(q.dtype).removeprefix('torch.')}", described(out))
    if (hook := getattr(_local, "after_layer", None)) is not None:
        hook(layer, kv_cache)
    return out


@torch.library.custom_op("modserve::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    # Writes this layer's KV cache, which is no input of the op: no graph reads it.
    return _attend(q, k, v, layer).contiguous()  # the fake below promises a fresh contiguous tensor


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention of layer ``layer``: q ``[T, H, D]``, k and v ``[T, Hkv, D]`` -> ``[T, H, D]``."""
    if torch.compiler.is_compiling():
        return _attention_op(q, k, v, layer)
    return _attend(q, k, v, layer)
