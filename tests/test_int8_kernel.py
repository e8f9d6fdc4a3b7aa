"""The int8 quantizer's C++ op (csrc/int8_linear.cpp) on every path this build compiled.

Each path (AVX-512, AVX2, the generic vector-extension code) is checked against the product
in float64 at every row count a pass takes (1-8), two passes (9-16) and beyond (passes over
blocks of q that stay in cache: 17, 24, 33), with shapes that run every tail: K with whole 64-byte lines, then whole vectors, then single
weights; N no multiple of the rows read side by side nor of a thread's claim. A path the
CPU lacks is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from modserve.quantizers.int8 import load_cpu_kernel

PATHS = {"avx512": "AVX-512F", "avx2": "AVX2", "generic": None}
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 33]
# K = 221: 3 lines + 29 (AVX-512: 1 vector + 13; AVX2: 3 vectors + 5); K = 1100 > the 1 KiB
# prefetch distance, so prefetches land both within a row and in the next rows; beyond 16
# rows, K = 4096 makes blocks of 64 weight rows, so N = 150 is two whole blocks and a part.
SHAPES = [(221, 300), (1100, 70)]
SHAPES_MANY_ROWS = [(4096, 150)]


@pytest.fixture(scope="module")
def paths() -> list[str]:
    assert load_cpu_kernel() is None
    return list(torch.ops.modserve_int8.paths())


def case(rows: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s, b = torch.rand(n, generator=g) / 50, torch.randn(n, generator=g)
    return torch.randn(rows, k, generator=g), q, s, b


def check(got: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> None:
    """float32 sums in any order: within a few float32 roundings of the sum of |terms|."""
    want = (x.double() @ q.double().T) * s.double()
    scale = (x.double().abs() @ q.double().abs().T) * s.double()
    if b is not None:
        want, scale = want + b.double(), scale + b.double().abs()
    assert got.shape == want.shape and got.dtype == torch.float32
    error = ((got.double() - want).abs() / scale).max().item()
    assert error < 2e-6, f"error {error:.2e} of the terms' magnitude"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_path_is_the_scaled_int8_product(paths, path, rows):
    if path not in paths:
        pytest.skip(f"this CPU lacks {PATHS[path]}, so the build (-march=native) has no {path} path")
    for k, n in SHAPES + (SHAPES_MANY_ROWS if rows > 16 else []):
        x, q, s, b = case(rows, k, n, seed=rows * 1000 + k)
        for bias in (b, None):
            check(torch.ops.modserve_int8.linear_path(x, q, s, bias, path), x, q, s, bias)


@pytest.mark.parametrize("rows", [1, 4, 8, 12])
def test_linear_runs_the_widest_path(paths, rows):
    x, q, s, b = case(rows, 221, 300, seed=rows)
    assert torch.equal(torch.ops.modserve_int8.linear(x, q, s, b),
                       torch.ops.modserve_int8.linear_path(x, q, s, b, paths[0]))
    assert paths[-1] == "generic" and set(paths) <= set(PATHS)


def test_unknown_path_names_the_paths(paths):
    x, q, s, b = case(1, 64, 8, seed=0)
    with pytest.raises(RuntimeError, match="no path 'neon' in this build.*generic"):
        torch.ops.modserve_int8.linear_path(x, q, s, b, "neon")


@pytest.mark.parametrize("rows", [1, 16, 17, 64])
def test_dynamic_activations_are_int8_beyond_16_rows(paths, rows):
    """linear_dynamic (W8A8): up to 16 rows linear()'s float32 activations, bit for bit; beyond,
    each row of x rounded to int8 at absmax / 127 and int8 x int8 summed exactly in int32."""
    x, q, s, b = case(rows, 1100, 70, seed=rows)
    got = torch.ops.modserve_int8.linear_dynamic(x, q, s, b)
    if rows <= 16:
        assert torch.equal(got, torch.ops.modserve_int8.linear(x, q, s, b))
        return
    x_scale = x.abs().amax(1, keepdim=True) / 127  # [rows, 1]
    xq = torch.round(x / x_scale).clamp(-127, 127)
    want = (xq.double() @ q.double().T) * x_scale.double() * s.double() + b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    float_activations = (x.double() @ q.double().T) * s.double() + b.double()
    assert not torch.allclose(got.double(), float_activations, rtol=1e-6, atol=1e-6)  # x was rounded


@pytest.fixture(scope="module")
def tiles(paths) -> None:
    if not torch.ops.modserve_int8.bf16_tiles():
        pytest.skip("this CPU has no AMX-BF16 tiles (torch's cpublas::could_pack(bfloat16) is false)")


# K = 2048 runs the product in two chunks of 1024 summed on the tiles; 2050 in one. N = 150:
# two blocks of 64 weight rows and a part. Rows: two passes (17, 64), a padded token block
# (65, 200), and more than one pass of 256 tokens (300).
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 65, 200, 300])
@pytest.mark.parametrize("k", [2048, 2050])
def test_bf16_activations_beyond_16_rows(tiles, rows, k):
    """linear_bf16: up to 16 rows linear()'s float32 activations, bit for bit; beyond, x rounded
    to bf16 times the exact int8 weights, summed in float32 and scaled."""
    x, q, s, b = case(rows, k, 150, seed=rows + k)
    for bias in (b, None):
        got = torch.ops.modserve_int8.linear_bf16(x, q, s, bias)
        if rows <= 16:
            assert torch.equal(got, torch.ops.modserve_int8.linear(x, q, s, bias))
            continue
        check(got, x.bfloat16().float(), q, s, bias)
        float_activations = (x.double() @ q.double().T) * s.double()
        assert not torch.allclose(got.double(), float_activations, rtol=1e-5, atol=1e-5)  # x was rounded


def test_bf16_activations_keep_float32_for_an_odd_k(tiles):
    """The tiles take K in pairs: an odd K runs linear()'s float32 activations, bit for bit."""
    x, q, s, b = case(40, 221, 70, seed=1)
    assert torch.equal(torch.ops.modserve_int8.linear_bf16(x, q, s, b), torch.ops.modserve_int8.linear(x, q, s, b))
