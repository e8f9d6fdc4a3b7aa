"""The CPU's linear routes for a bfloat16 checkpoint (modserve/plugins/platforms/cpu/features.py):
which one each CPU family takes, and each route's products against a reference, forced on
whatever CPU runs the tests (a route a CPU lacks the instructions for is skipped, saying so)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from modserve import LLM, SamplingParams
from modserve.plugins.platforms.cpu.features import cpu_features, parse_cpuinfo
from modserve.plugins.platforms.cpu.linear import load_few_rows_kernel, set_few_rows_floats
from modserve.plugins.platforms.cpu.native_decode import NativeDecodeStep
from modserve.testing import cached_checkpoint

EMERALD_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8592+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: ignored, the first processor's counts
flags\t\t: avx2
"""
ZEN4 = "model name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16\n"
HASWELL = "model name\t: Intel(R) Xeon(R) CPU E5-2680 v3\nflags\t\t: avx avx2 fma\n"
ICE_LAKE = ("model name\t: Intel(R) Xeon(R) Processor @ 2.80GHz\n"
            "flags\t\t: avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_vbmi2\n")


def test_each_cpu_family_gets_its_route_and_a_name_a_figure_can_carry():
    spr = parse_cpuinfo(EMERALD_RAPIDS)
    assert spr.model == "Intel(R) Xeon(R) Platinum 8592+"
    assert spr.describe() == ("Intel(R) Xeon(R) Platinum 8592+ (avx2 avx512f avx512_vnni avx512_bf16 avx512_fp16 "
                              "amx_bf16 amx_int8)")
    assert spr.default_route() == "bf16_gemm"
    assert parse_cpuinfo(ZEN4).default_route() == "few_rows"
    assert parse_cpuinfo(HASWELL).default_route() == "few_rows"
    ice_lake = parse_cpuinfo(ICE_LAKE)
    assert ice_lake.describe() == "Intel(R) Xeon(R) Processor @ 2.80GHz (avx2 avx512f avx512_vnni)"
    # no bf16 instructions: oneDNN's bf16 GEMM converts in software, slower than either float32 way
    assert ice_lake.default_route() == "few_rows"
    # the few-rows kernel's vector width: AVX-512 where there is no AVX512-BF16, else Zen 4's 8 floats
    assert [parse_cpuinfo(c).few_rows_floats() for c in (ICE_LAKE, ZEN4, EMERALD_RAPIDS, HASWELL)] == [16, 8, 8, 8]
    assert parse_cpuinfo(HASWELL).describe() == "Intel(R) Xeon(R) CPU E5-2680 v3 (avx2)"
    assert parse_cpuinfo("").describe() == "unknown CPU (no vector extensions we use)"


def test_forced_flags_replace_the_cpus_and_unknown_ones_are_refused(monkeypatch):
    cpu_features.cache_clear()
    try:
        monkeypatch.setenv("MODSERVE_CPU_FLAGS", "avx2 amx_bf16")
        assert cpu_features().flags == {"avx2", "amx_bf16"} and cpu_features().default_route() == "bf16_gemm"
        cpu_features.cache_clear()
        monkeypatch.setenv("MODSERVE_CPU_FLAGS", "avx2 amx")
        with pytest.raises(ValueError, match=r"MODSERVE_CPU_FLAGS: unknown \['amx'\]; known: avx2 avx512f"):
            cpu_features()
    finally:
        cpu_features.cache_clear()


def _kernels():
    if not load_few_rows_kernel():
        pytest.skip("the CPU kernels cannot be built here (the log says why)")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16, times bf16 weights, summed in float64."""
    return x.bfloat16().double() @ w.double().t()


@pytest.mark.parametrize("n, k", [(1280, 768), (37, 100), (5, 32), (9, 70)])
def test_the_avx512_bf16_dot_kernel_equals_a_reference_product(n, k):
    _kernels()
    if not torch.ops.modserve_cpu.bf16_dot_built():
        pytest.skip(f"{cpu_features().model} has no AVX512-BF16: the dot kernel is not built for it")
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    for m in (1, 2, 3, 4, 5):
        x = torch.randn(m, k, generator=g)
        y = torch.ops.modserve_cpu.bf16_dot_linear(x, w)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        torch.testing.assert_close(y.double(), _reference(x, w), atol=2e-5, rtol=1e-5)


def _layout(packed: str, w: torch.Tensor) -> torch.Tensor | None:
    if packed == "tiles":
        if not torch.ops.modserve_cpu.tiles_ready():
            pytest.skip("this CPU has no AMX-BF16 tiles (torch's cpublas::could_pack(bfloat16) is false)")
        return torch.ops.modserve_cpu.pack_tiles(w)
    return torch.ops.mkldnn._reorder_linear_weight(w, 64) if packed == "onednn" else None


@pytest.mark.parametrize("packed", ["plain", "onednn", "tiles"])
@pytest.mark.parametrize("m", [1, 3, 4, 17, 64, 257, 300, 304])
def test_the_bf16_gemm_route_equals_a_reference_product_at_every_row_count(m, packed):
    """Up to three rows the dot kernel (where built), more oneDNN's bf16 GEMM, whose output is
    rounded to bf16, from the weight packed at load up to 256 rows: all within a bf16 rounding
    of the float64 product, bias in float32. From the AMX tiles' layout, up to 256 rows: x
    rounded to bf16 and float32 sums, unrounded (to float32 error of the rounded x's product)."""
    _kernels()
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 160, generator=g) * 0.05).bfloat16()
    x, bias = torch.randn(m, 160, generator=g), torch.randn(96, generator=g)
    y = torch.ops.modserve_cpu.bf16_gemm_linear(x, w, _layout(packed, w), bias)
    expected = _reference(x, w) + bias.double()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, atol=1e-2, rtol=8e-3)
    if packed == "tiles" and m <= 256:
        exact = x.bfloat16().double() @ w.double().T + bias.double()
        torch.testing.assert_close(y.double(), exact, atol=1e-5, rtol=1e-5)


def test_prefill_rows_share_onednns_kernels():
    """Beyond 256 rows (a prefill), the GEMM's rows are padded to a multiple of 16: oneDNN
    makes a kernel per row count on its first call, so 289, 300 and 304 rows share one
    (``ONEDNN_VERBOSE=all`` logs each primitive made as ``create:cache_miss``), and 305 makes
    the next. A fresh process: oneDNN's primitive cache is per process."""
    _kernels()
    code = (
        "import torch\n"
        "from modserve.plugins.platforms.cpu.linear import load_few_rows_kernel\n"
        "assert load_few_rows_kernel()\n"
        "w = torch.randn(96, 160).bfloat16()\n"
        "for m in (289, 300, 304, 305):\n"
        "    x = torch.randn(m, 160).bfloat16()\n"
        "    y = torch.ops.modserve_cpu.bf16_gemm(x, w, None)\n"
        "    assert y.shape == (m, 96) and y.is_contiguous()\n"
        "    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=1e-2, rtol=8e-3)\n"
        "    print('done', m, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ONEDNN_VERBOSE": "all"})
    assert done.returncode == 0, done.stderr[-3000:]
    made, counts = {}, []
    for line in done.stdout.splitlines():
        if line.startswith("done"):
            counts.append(sum(made.values()))
        elif "create:cache_miss" in line and ",matmul," in line:
            made[line] = made.get(line, 0) + 1
    assert len(counts) == 4 and counts[0] >= 1, done.stdout[-3000:]
    assert counts[2] == counts[0], "289, 300 and 304 rows should share one kernel"
    assert counts[3] > counts[2], "305 rows pads to 320: a new kernel"


@pytest.mark.parametrize("n,k", [(64, 64), (200, 2048)])
def test_the_tiles_layout_holds_every_weight_once(n, k):
    """A weight of whole 64-feature blocks and one with a partial last block, and K = 2048 (rows
    of x 4 KiB apart; one row by the vdpbf16ps kernel, then below 48 rows a tile of 16 rows at
    a time, from 48 K in chunks of 256): the product from the tiles is the product of the
    weight."""
    _kernels()
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    tiles = _layout("tiles", w)
    assert tiles.shape == (-(-n // 64), k * 64)
    for m in (1, 3, 16, 2, 24, 40, 256, 4):
        x = torch.randn(m, k, generator=g)
        y = torch.ops.modserve_cpu.bf16_gemm_linear(x, w, tiles, None)
        torch.testing.assert_close(y.double(), x.bfloat16().double() @ w.double().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 32])
def test_the_tiles_route_rounds_x_as_torch_does(m):
    """x is rounded to bf16 on the calling thread, not by Tensor.copy_: to nearest, ties to
    even, carries into the exponent, rows of a strided x; through an identity weight the
    products are x as torch rounds it (the dot loop at one row, the brgemm at two, the tiles'
    own kernel at 32)."""
    _kernels()
    k = 64
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x3F808001, 0xBF808000, 0x7F7F0000,
                         0x477FE000, 0x3F800000, 0x00000000, 0x80000000], dtype=torch.int64).to(torch.int32)
    g = torch.Generator().manual_seed(m)
    wide = torch.randn(m, 2 * k, generator=g) * 100
    wide[:, : 2 * len(bits) : 2] = bits.view(torch.float32)
    x = wide[:, ::2]  # every other column: rows K apart, values 2 apart (the copy_ route)
    w = torch.eye(k).bfloat16()
    tiles = _layout("tiles", w)
    for xx in (x, x.contiguous(), wide[:, :k]):
        y = torch.ops.modserve_cpu.bf16_gemm_linear(xx, w, tiles, None)
        assert torch.equal(y, xx.bfloat16().float()), (y - xx.bfloat16().float()).abs().max()


@pytest.mark.parametrize("n,k", [(200, 2048), (96, 160), (64, 3072)])
def test_the_tiles_kernel_sums_as_the_brgemm_does(n, k):
    """From 32 rows (K a multiple of 32) the tiles' own kernel takes the product, a chunk of
    1,024 K at a time with the sums carried in y, rows in pairs of tiles and an odd last tile
    alone: its sums are oneDNN's brgemm's (``set_tiles_amx(False)``), bit for bit."""
    _kernels()
    ops = torch.ops.modserve_cpu
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    tiles = _layout("tiles", w)
    for m in (17, 32, 48, 64, 100, 256):
        x = torch.randn(m, k, generator=g)
        own = ops.bf16_gemm_linear(x, w, tiles, None)
        ops.set_tiles_amx(False)
        try:
            brgemm = ops.bf16_gemm_linear(x, w, tiles, None)
        finally:
            ops.set_tiles_amx(True)
        assert torch.equal(own, brgemm), (m, (own - brgemm).abs().max())


@pytest.mark.parametrize("packed", ["onednn", "tiles"])
@pytest.mark.parametrize("m", [2, 17, 300])
def test_the_bf16_gemm_route_under_compile_keeps_its_casts_in_the_graph(m, packed):
    """A compiled forward calls ``bf16_gemm`` on bf16 rows and casts around it in its graph
    (where inductor fuses the casts into the ops beside the GEMM): the products equal the
    eager route's, whose float32 output from the dot kernel (up to three rows) is rounded to
    bf16 there, as oneDNN's is at every row count."""
    from modserve.plugins.platforms.cpu import linear

    _kernels()
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 160, generator=g) * 0.05).bfloat16()
    x, bias = torch.randn(m, 160, generator=g), torch.randn(96, generator=g)
    layout = _layout(packed, w)
    old, linear._bf16_kernel = linear._bf16_kernel, True
    try:
        torch._dynamo.reset()
        graph = []
        compiled = torch.compile(lambda a: torch.nn.functional.gelu(linear.linear_or_gemv(a, w, bias, None, layout)),
                                 backend=lambda gm, _: graph.append(gm) or gm)
        y = compiled(x)
    finally:
        linear._bf16_kernel = old
    ops = [n.target for n in graph[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.modserve_cpu.bf16_gemm in ops and torch.ops.modserve_cpu.bf16_gemm_linear not in ops
    eager = torch.ops.modserve_cpu.bf16_gemm_linear(x, w, layout, None)
    want = torch.nn.functional.gelu(eager.bfloat16().float() + bias)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def bf16_path():
    return str(cached_checkpoint("llama", "tiny", dtype="bfloat16"))


def _llm(path: str, route: str, **kw) -> LLM:
    return LLM(path, num_kv_blocks=128, progress=False, platform={"name": "cpu", "options": {"bf16_gemm": route}},
               **kw)


@torch.inference_mode()
def test_the_bf16_gemm_route_keeps_bf16_weights_decodes_natively_and_tracks_float32(bf16_path, caplog):
    """Forced on: the linears hold bf16 weights only (the tied or untied head included), steps
    of decodes run natively without compile, and the prompt's logits stay within bf16's
    rounding of transformers' float32 ones."""
    _kernels()
    with caplog.at_level("INFO", logger="modserve"):
        llm = _llm(bf16_path, "on", compile="off")
    assert "linears read the checkpoint's bfloat16 weights through oneDNN's bf16 GEMM" in caplog.text
    model = llm.engine.runner.model
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert all(layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16 for layer in model.layers)
    assert model.embed_tokens.weight.dtype == torch.float32
    assert isinstance(llm.engine.runner.step_forward, NativeDecodeStep)
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16  # kv_cache_dtype auto: vLLM's bf16 KV
    prompt = [11, 250, 37, 902, 14, 3, 77, 1200]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(bf16_path, dtype=torch.float32).eval()
    logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    top = ours.logprobs[0]["top"]
    assert len(top) == 5
    for token, logprob in top.items():
        assert abs(logprob - logprobs[token].item()) < 0.05, (token, logprob, logprobs[token].item())


@torch.inference_mode()
def test_the_bf16_gemm_route_packs_its_weights_for_decode_batches(bf16_path):
    """prepack_weights on: each bf16 linear gets a packed layout beside its plain weight (the AMX
    tiles' where the CPU has them, whose sums are not rounded to bf16; else oneDNN's), and
    batched decode gives the logprobs of the unpacked engine to bf16 rounding: token for token
    up to a near-tie, where both pick a token of about the same logprob and go separate ways."""
    _kernels()
    prompts = [[11, 250, 37, 902, 14, 3], [7] * 19, [1200, 5, 5, 86, 400]] * 3  # decode steps of 9 rows
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    runs = {}
    for prepack in ("on", "off"):
        llm = _llm(bf16_path, "on", compile="off", prepack_weights=prepack)
        layer = llm.engine.runner.model.layers[0].self_attn.o_proj
        assert (getattr(layer, "packed_weight", None) is not None) == (prepack == "on")
        runs[prepack] = llm.generate(prompts, params, use_tqdm=False)
    same = 0
    for packed, plain in zip(runs["on"], runs["off"]):
        a, b = packed.outputs[0], plain.outputs[0]
        for token_a, token_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            assert abs(lp_a[token_a].logprob - lp_b[token_b].logprob) < 0.02
            if token_a != token_b:
                break
            same += 1
    assert same >= 0.75 * sum(len(r.outputs[0].token_ids) for r in runs["off"])


@torch.inference_mode()
def test_routes_forced_off_and_by_cpu_flags(bf16_path, monkeypatch, caplog):
    """off: float32 weights with a bf16 decode copy (the few-rows route), here under an Ice
    Lake Xeon's flags (AVX-512F, no AVX512-BF16): its kernel computes in 16-float vectors where
    the build has AVX-512 (logged), and the prompt's logprobs stay transformers' float32 ones;
    auto follows the CPU's flags, here forced to an Ice Lake's, a Zen 4's and an AMX CPU's;
    dtype float32 or a float32 checkpoint never take the bf16 route, and asking for it there
    is refused."""
    cpu_features.cache_clear()
    try:
        monkeypatch.setenv("MODSERVE_CPU_FLAGS", "avx2 avx512f avx512_vnni")
        cpu_features.cache_clear()
        with caplog.at_level("INFO", logger="modserve"):
            off = _llm(bf16_path, "off", compile="on")
        layer = off.engine.runner.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.float32 and layer.decode_weight.dtype == torch.bfloat16
        if load_few_rows_kernel():  # where it cannot be built, a compiled GEMV reads the copy
            ops = torch.ops.modserve_cpu
            wide = 16 if ops.few_rows_avx512_built() else 8  # the 16-float kernel: tests/test_cpu_kernels.py
            assert f"weights (half the bytes) and accumulate in float32 ({wide}-float vectors)" in caplog.text
            assert ops.few_rows_floats() == wide
            assert set_few_rows_floats(parse_cpuinfo(ZEN4)) == 8 and ops.few_rows_floats() == 8
            set_few_rows_floats(cpu_features())
        prompt = [11, 250, 37, 902, 14, 3, 77, 1200]  # a prefill of 8 rows: the few-rows kernel's
        ours = off.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, logprobs=5),
                            use_tqdm=False)[0].outputs[0]
        hf = AutoModelForCausalLM.from_pretrained(bf16_path, dtype=torch.float32).eval()
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        for token, logprob in ours.logprobs[0]["top"].items():
            assert abs(logprob - expected[token].item()) < 1e-3, (token, logprob, expected[token].item())
        for flags, dtype in (("avx2 avx512f avx512_vnni", torch.float32), ("avx2 avx512f avx512_bf16", torch.float32),
                             ("avx2 avx512f amx_bf16", torch.bfloat16)):
            monkeypatch.setenv("MODSERVE_CPU_FLAGS", flags)
            cpu_features.cache_clear()
            llm = _llm(bf16_path, "auto", compile="off")
            assert llm.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == dtype, flags
        exact = _llm(bf16_path, "auto", dtype="float32", compile="off")
        assert exact.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
        assert exact.engine.runner.kv_caches[0].dtype == torch.float32
        # a backend that cannot read the route's bf16 KV gets the compute dtype's
        reference = _llm(bf16_path, "on", compile="off", attention_backend="reference")
        assert reference.engine.runner.kv_caches[0].dtype == torch.float32
    finally:
        cpu_features.cache_clear()
        if load_few_rows_kernel():
            set_few_rows_floats(cpu_features())
    with pytest.raises(Exception, match=r"bf16_gemm: on, but the checkpoint is float32, not bfloat16"):
        _llm(str(cached_checkpoint("llama", "tiny")), "on")
