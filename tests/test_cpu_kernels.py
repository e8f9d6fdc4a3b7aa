"""The CPU platform's C++ kernel: float32 rows against bfloat16 weights (few-row steps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modserve.plugins.platforms.cpu.linear import FEW_ROWS, load_few_rows_kernel
from modserve.plugins.platforms.cpu.prepack import packed_linear, to_panels


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert load_few_rows_kernel(), "the C++ kernel did not build here (see the warning logged)"


def few_rows_linear(*args):
    return torch.ops.modserve_cpu.few_rows_linear(*args)


@pytest.fixture(params=[8, 16], ids=["8-float", "16-float"])
def few_rows_floats(request):
    """The kernel at each vector width it has (16: AVX-512, set where the CPU has AVX-512F but
    no AVX512-BF16), restored after."""
    ops = torch.ops.modserve_cpu
    if request.param == 16 and not ops.few_rows_avx512_built():
        pytest.skip("the kernel was built without AVX-512F: this CPU has no 16-float path")
    before = ops.few_rows_floats()
    ops.set_few_rows_floats(request.param)
    yield request.param
    ops.set_few_rows_floats(before)


@pytest.mark.parametrize("rows", range(1, FEW_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [64, 72])  # 72: the split accumulators' 16-32 columns do not divide it
def test_bf16_linear_matches_float32_on_the_same_weights(rows, bias, k, few_rows_floats):
    g = torch.Generator().manual_seed(rows)
    # 200: not a multiple of the 64-feature grain; 203: nor of the 3 or 4 weight rows read at once
    for n in (200, 203):
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(rows, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        expected = F.linear(x.double(), w.double(), None if b is None else b.double())
        out = torch.ops.modserve_cpu.bf16_linear(x, w, b)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_16_float_width_is_refused_where_the_build_lacks_avx512():
    ops = torch.ops.modserve_cpu
    with pytest.raises(RuntimeError, match="8 or 16, not 4"):
        ops.set_few_rows_floats(4)
    if ops.few_rows_avx512_built():
        pytest.skip("the kernel was built with AVX-512F here: 16 floats are accepted")
    with pytest.raises(RuntimeError, match="16-float vectors need a build with AVX-512F"):
        ops.set_few_rows_floats(16)


def test_bf16_linear_of_no_rows_is_empty():
    w = torch.randn(24, 16).bfloat16()
    out = torch.ops.modserve_cpu.bf16_linear(torch.zeros(0, 16), w, torch.ones(24))
    assert out.shape == (0, 24)


def test_few_rows_linear_takes_float32_weights_beyond_few_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=g).bfloat16().float()
    x = torch.randn(FEW_ROWS + 1, 16, generator=g)
    out = few_rows_linear(x, w, w.bfloat16(), None, None)
    assert torch.equal(out, F.linear(x, w))  # the float32 GEMM itself, bit for bit
    few = few_rows_linear(x[:FEW_ROWS], w, w.bfloat16(), None, None)
    torch.testing.assert_close(few, F.linear(x[:FEW_ROWS], w), rtol=1e-5, atol=1e-5)
    b = torch.randn(32, generator=g)
    # beyond 16 rows, with a packed copy: its GEMM (panels: the C++ kernel; oneDNN's layout: oneDNN)
    for packed in (to_panels(w), torch.ops.mkldnn._reorder_linear_weight(w, None)):
        torch.testing.assert_close(few_rows_linear(x, w, w.bfloat16(), packed, b), packed_linear(x, packed, b, 32),
                                   rtol=0, atol=0)


# rows: tiles of 6 (8-float) rows and their tails; from 24 rows 16-float tiles of up to 12
# (25: 9 + 8 + 8); 300: two chunks. n: pairs of panels (96: 6), a part-filled last panel
# alone (40: 3), a full one alone (112: 7).
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 24, 25, 64, 300])
@pytest.mark.parametrize("n, k", [(96, 64), (40, 37), (112, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_float64(rows, n, k, bias, few_rows_floats):
    g = torch.Generator().manual_seed(rows * n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    out = torch.ops.modserve_cpu.panel_linear(x, to_panels(w), n, b)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # one FMA chain per output, in k order: a row's result does not depend on its batch
    assert torch.equal(torch.ops.modserve_cpu.panel_linear(x[-1:], to_panels(w), n, b), out[-1:])
    if few_rows_floats == 16:  # the same chains as the 8-float tiles: the same bits
        torch.ops.modserve_cpu.set_few_rows_floats(8)
        assert torch.equal(torch.ops.modserve_cpu.panel_linear(x, to_panels(w), n, b), out)


@pytest.mark.parametrize("x, panels, n, message", [
    (torch.zeros(2, 16), torch.zeros(3, 16, 16), 50, "3 panels do not hold 50"),
    (torch.zeros(2, 16), torch.zeros(3, 16, 16), 32, "3 panels do not hold 32"),
    (torch.zeros(2, 12), torch.zeros(1, 16, 16), 16, r"x \[M, K\], panels"),
    (torch.zeros(2, 16), torch.zeros(1, 16, 16, dtype=torch.bfloat16), 16, "float32 x and panels"),
])
def test_panel_linear_names_what_is_wrong(x, panels, n, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.modserve_cpu.panel_linear(x, panels, n, None)


@pytest.mark.parametrize("x, w, message", [
    (torch.zeros(17, 16), torch.zeros(4, 16, dtype=torch.bfloat16), "at most 16 rows"),
    (torch.zeros(2, 12), torch.zeros(4, 12, dtype=torch.bfloat16), "K a multiple of 8"),
    (torch.zeros(2, 16), torch.zeros(4, 16), "float32 x, bfloat16 weight"),
    (torch.zeros(2, 16), torch.zeros(4, 8, dtype=torch.bfloat16), r"x \[M, K\], weight \[N, K\]"),
])
def test_bf16_linear_names_what_is_wrong(x, w, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.modserve_cpu.bf16_linear(x, w, None)


def test_two_checkouts_of_a_kernel_build_in_folders_of_their_own(tmp_path):
    """ninja's build file names the source by its path: checkouts sharing a folder would rebuild
    each other's library on every switch (an A/B of two worktrees rebuilt at each start)."""
    from modserve.api.cpp import build_directory

    first, second = tmp_path / "a" / "kernel.cpp", tmp_path / "b" / "kernel.cpp"
    for source in (first, second):
        source.parent.mkdir()
        source.write_text("int answer() { return 42; }\n")
    folder = build_directory("kernel", str(first))
    assert build_directory("kernel", str(second)) != folder
    assert build_directory("kernel", str(tmp_path / "b" / ".." / "a" / "kernel.cpp")) == folder  # the same file
    first.write_text("int answer() { return 43; }\n")
    assert build_directory("kernel", str(first)) != folder  # a changed source never loads a stale library
