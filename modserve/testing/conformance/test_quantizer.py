"""Quantizer: a loaded layer's matmul agrees with its dequantized weight, which stands for the
checkpoint's, in the bytes it plans; fused shards load in any order.

Layers of 64 inputs, built through :class:`~modserve.api.Linear` as a model builds them
(:mod:`.quantized_layers`), on the CPU; and the tiny Llama's projections as the two ranks of
tensor parallelism build them, each shard standing for its slice of the whole layer.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from modserve.api import Quantizer, TensorParallel, op_by_name
from modserve.testing.conformance.quantized_layers import (
    FORMATS, FUSED, TP, TP_LAYERS, Layer, build, checkpoint_format, float_linear, kept_bytes, parallel_linear,
    rank_rows, shard,
)
from modserve.testing.conformance.targets import Implementation

CONFORMANCE_KIND = "quantizer"
pytestmark = pytest.mark.usefixtures("modserve_one_thread")

LAYOUTS = [(torch.float32, True), (torch.bfloat16, False)]  # (activation dtype, bias)
ATOL = {torch.float32: 5e-5, torch.bfloat16: 3e-2}  # outputs are about 1; bfloat16 keeps 8 bits
MAX_ERROR = 0.15  # relative Frobenius error of the dequantized weight; 4-bit groups of 32 give ~0.1


def make(implementation: Implementation) -> tuple[Quantizer, str | None]:
    try:
        fmt = checkpoint_format(implementation.load())
    except LookupError as e:
        pytest.skip(f"{implementation}: {e}")
    return implementation.create(None if fmt is None else dict(FORMATS[fmt][0])), fmt


def layer_for(implementation: Implementation, shard_sizes: tuple[int, ...] = (48,), order: list[int] | None = None,
              dtype: torch.dtype = torch.float32, bias: bool = True) -> Layer:
    quantizer, fmt = make(implementation)
    try:
        return build(quantizer, fmt, shard_sizes, order if order is not None else list(range(len(shard_sizes))),
                     bias, dtype)
    except LookupError as e:
        pytest.skip(f"{implementation}: {e}")


@pytest.mark.parametrize("dtype,bias", LAYOUTS, ids=lambda v: str(v).removeprefix("torch."))
def test_apply_matches_the_dequantized_weight(implementation: Implementation, dtype: torch.dtype, bias: bool) -> None:
    """``apply(layer, x)`` is ``x @ dequantize(layer).T + bias``: ``[T, in]`` to ``[T, out]`` in ``spec.dtype``."""
    layer = layer_for(implementation, dtype=dtype, bias=bias)
    lin = layer.linear
    x = torch.randn(5, lin.spec.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)  # [T, in]
    y = lin.quantizer.apply(lin, x)
    assert tuple(y.shape) == (5, lin.spec.out_features) and y.dtype == dtype, (
        f"apply must return [T, out] = [5, {lin.spec.out_features}] {dtype}, got {tuple(y.shape)} {y.dtype}")
    want = x.double() @ lin.quantizer.dequantize(lin).double().T  # [T, out]
    if bias:
        want += lin.bias.double()
    error = float((y.double() - want).abs().max())
    assert error <= ATOL[dtype], (f"apply differs from x @ dequantize(layer).T{' + bias' if bias else ''} "
                                  f"by {error:.3g} (tolerance {ATOL[dtype]:g}, {dtype})")


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_native_op_is_apply(implementation: Implementation, rows: int) -> None:
    """``native_op(layer)``, where it names one: ``op(x, *args)`` is ``apply(layer, x)`` for float32
    ``x [T, in]`` (a native decode step calls it in ``apply``'s place)."""
    layer = layer_for(implementation, dtype=torch.float32, bias=True)
    lin = layer.linear
    native = lin.quantizer.native_op(lin)
    if native is None:
        pytest.skip(f"{implementation} names no native op for this layer")
    name, args = native
    op = op_by_name(name)
    x = torch.randn(rows, lin.spec.in_features, generator=torch.Generator().manual_seed(2))  # [T, in]
    y = op(x, *args)
    want = lin.quantizer.apply(lin, x)
    assert isinstance(y, torch.Tensor) and y.shape == want.shape and y.dtype == want.dtype, (
        f"{name} must return apply's [T, out] = {tuple(want.shape)} {want.dtype}, got {getattr(y, 'shape', y)}")
    error = float((y - want).abs().max())
    assert error <= ATOL[torch.float32], f"{name}(x, *args) differs from apply(layer, x) by {error:.3g} ({rows} rows)"


@pytest.mark.parametrize("dtype,bias", LAYOUTS, ids=lambda v: str(v).removeprefix("torch."))
def test_dequantize_stands_for_the_checkpoint(implementation: Implementation, dtype: torch.dtype, bias: bool) -> None:
    """``dequantize`` is the ``[out, in]`` float32 weight: the reference dequantization of a
    pre-quantized checkpoint (exactly in float32; in 16 bits a kernel may keep its scales in the
    activation dtype), and close to a float checkpoint's weight."""
    layer = layer_for(implementation, dtype=dtype, bias=bias)
    lin = layer.linear
    w = lin.quantizer.dequantize(lin)
    assert tuple(w.shape) == (lin.spec.out_features, lin.spec.in_features) and w.dtype == torch.float32, (
        f"dequantize must be [out, in] = [{lin.spec.out_features}, {lin.spec.in_features}] float32, "
        f"got {tuple(w.shape)} {w.dtype}")
    if layer.reference is not None:
        rtol = 0.0 if dtype == torch.float32 else 2.0 ** -8  # a scale rounded to bfloat16
        assert torch.allclose(w, layer.reference, rtol=rtol, atol=1e-6), (
            f"dequantize differs from the checkpoint's dequantization by "
            f"{float((w - layer.reference).abs().max()):.3g}")
    error = float((w - layer.weight).norm() / layer.weight.norm())
    assert error <= MAX_ERROR, (f"dequantize is {error:.3f} (relative) away from the loaded weight: it must stand for "
                                f"the checkpoint's weight (at most {MAX_ERROR})")


@pytest.mark.parametrize("shard_sizes", [(48,), FUSED], ids=["unfused", "fused"])
def test_weight_bytes_are_what_the_layer_keeps(implementation: Implementation, shard_sizes: tuple[int, ...]) -> None:
    """``weight_bytes(spec)`` is the bytes of every tensor the layer keeps after ``process_weights``
    (its bias aside): the engine plans capacity with it."""
    lin = layer_for(implementation, shard_sizes).linear
    planned, kept = lin.quantizer.weight_bytes(lin.spec), kept_bytes(lin)
    names = sorted(n for n, _ in (*lin.named_parameters(), *lin.named_buffers()) if n != "bias")
    assert planned == kept, f"weight_bytes(spec) = {planned}, but the layer keeps {kept} bytes in {names}"


def test_fused_shards_load_in_any_order(implementation: Implementation) -> None:
    """A fused layer (three output shards) gives the same weight and output whatever order its
    shards arrive in, each shard's rows standing for that shard's weight."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    results = []
    for order in itertools.permutations(range(len(FUSED))):
        layer = layer_for(implementation, FUSED, list(order))
        lin = layer.linear
        results.append((order, lin.quantizer.dequantize(lin), lin.quantizer.apply(lin, x)))
    first_order, first_w, first_y = results[0]
    for order, w, y in results[1:]:
        assert torch.equal(w, first_w), f"shards loaded in order {order} dequantize differently from {first_order}"
        assert torch.allclose(y, first_y, atol=1e-5), (
            f"shards loaded in order {order} apply differently from {first_order}")
    error = float((first_w - layer.weight).norm() / layer.weight.norm())
    assert error <= MAX_ERROR, f"the fused layer's weight is {error:.3f} (relative) away from its shards' weights"


def test_an_unknown_tensor_name_is_an_error_naming_it(implementation: Implementation) -> None:
    """``load_weight`` of a checkpoint tensor the quantizer does not read raises, naming it."""
    lin = layer_for(implementation).linear
    try:
        lin.quantizer.load_weight(lin, "unknown_tensor", torch.zeros(48, 64), 0)
    except Exception as e:  # noqa: BLE001 - any error, as long as it names the tensor
        assert "unknown_tensor" in str(e), f"the error must name the tensor 'unknown_tensor'; it says: {e}"
        return
    pytest.fail("load_weight took a checkpoint tensor named 'unknown_tensor' without an error: a name the "
                "quantizer does not read must be an error naming it (else a mis-quantized checkpoint loads silently)")


@pytest.mark.parametrize("layer", list(TP_LAYERS))
def test_tensor_parallel_shards_are_slices_of_the_whole_layer(implementation: Implementation, layer: str) -> None:
    """Each rank of two (``TensorParallel(rank, 2)``, no process group: only the core's slicing by
    ``tensor_layout(name, spec)`` runs) loads the same checkpoint tensors as the whole layer. A
    pre-quantized checkpoint's shard dequantizes exactly to its part of the whole layer's weight:
    a column shard (qkv_proj, its KV shard replicated; gate_up_proj) to its rows, a row shard
    (o_proj, down_proj) to its columns. A float checkpoint's shard is what the quantizer makes of
    that slice of the float weight on its own (a quantize-at-load quantizer computes a row
    shard's scales from its own columns). Either way ``weight_bytes(spec)`` is what the shard
    keeps and ``apply`` agrees with its ``dequantize``."""
    quantizer, fmt = make(implementation)
    k, sizes, parallel, replicas = TP_LAYERS[layer]
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, k, generator=gen) * 0.1 for n in sizes]  # [rows, in] per checkpoint shard
    shards = [shard(fmt, w, torch.float32).tensors for w in weights]
    try:
        whole = parallel_linear(quantizer, layer, TensorParallel(), shards)
    except LookupError as e:
        pytest.skip(f"{implementation}: {e}")
    w = quantizer.dequantize(whole)  # [out, in]
    for rank in range(TP):
        where = f"{layer} ({parallel}-parallel), rank {rank} of {TP}"
        try:
            part, problem = parallel_linear(quantizer, layer, TensorParallel(rank, TP), shards), None
        except Exception as e:  # noqa: BLE001 - any error: the shard cannot load its slices
            problem = f"{type(e).__name__}: {str(e).rstrip('.')}"
        if problem is not None:
            pytest.fail(f"{where}: loading its slices of the checkpoint tensors failed: {problem}. The core narrows "
                        f"each tensor where tensor_layout(name, spec) puts its output and input channels (dimension, "
                        f"channels per element); what it hands load_weight must then fit what create_weights(spec) "
                        f"registered for this rank's spec")
        spec = part.spec
        got = quantizer.dequantize(part)
        if parallel == "column":
            if fmt is None:
                alone = [w_i[start : start + n] for w_i, start, n in zip(weights, spec.shard_starts, spec.shard_sizes)]
                want, what = quantizer.dequantize(float_linear(quantizer, alone)), "its own layer of its float rows"
            else:
                rows = rank_rows(sizes, replicas, TensorParallel(rank, TP))
                want, what = w[rows], f"rows {rows.tolist()[:3]}... of the whole layer's weight"
        else:
            cols = slice(spec.in_start, spec.in_start + spec.in_features)
            if fmt is None:
                want = quantizer.dequantize(float_linear(quantizer, [weights[0][:, cols]]))
                what = f"its own layer of columns {cols.start}:{cols.stop} of the float weight"
            else:
                want, what = w[:, cols], f"columns {cols.start}:{cols.stop} of the whole layer's weight"
        assert tuple(got.shape) == tuple(want.shape), (
            f"{where}: dequantize is {tuple(got.shape)}, its shard is [out, in] = {tuple(want.shape)}")
        assert torch.equal(got, want), (
            f"{where}: dequantize differs from {what} (max {float((got - want).abs().max()):.3g}): the shard must "
            f"stand for its slice of the checkpoint (tensor_layout must say where each tensor's channels are)")
        planned, kept = quantizer.weight_bytes(spec), kept_bytes(part)
        assert planned == kept, f"{where}: weight_bytes(spec) = {planned}, but the shard keeps {kept} bytes"
        x = torch.randn(5, spec.in_features, generator=gen)  # [T, this rank's inputs]
        error = float((quantizer.apply(part, x).double() - x.double() @ got.double().T).abs().max())
        assert error <= ATOL[torch.float32], f"{where}: apply differs from x @ dequantize(shard).T by {error:.3g}"
