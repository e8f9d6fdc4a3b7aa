"""Quantizer: a loaded layer's matmul agrees with its dequantized weight, which stands for the
checkpoint's, in the bytes it plans; fused shards load in any order.

Layers of 64 inputs, built through :class:`~modserve.api.Linear` as a model builds them
(:mod:`.quantized_layers`), on the CPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from modserve.api import Quantizer
from modserve.testing.conformance.quantized_layers import FORMATS, FUSED, Layer, build, checkpoint_format, kept_bytes
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
