"""prepack_weights: packed float32 weights for batched CPU GEMMs (panels for the C++ kernel,
or oneDNN's layout), held against transformers (greedy tokens) and the unpacked path
(logprobs), compiled and eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modserve import LLM, SamplingParams
from modserve.api import float_layers, op_by_name
from modserve.bench.cli import _gemm_dtype
from modserve.plugins.platforms.cpu.kernels import bf16_linear_ready
from modserve.plugins.platforms.cpu.linear import linear_or_gemv
from modserve.plugins.platforms.cpu.prepack import packed_linear, to_panels
from modserve.testing import cached_checkpoint

from test_compile import FEW_ROWS, MAX_NEW, bf16_reference, compiled_llm  # noqa: F401  (fixtures)


@pytest.mark.parametrize("layout", ["panels", "onednn"])
@pytest.mark.parametrize("rows", [1, 3, 17, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias, layout):
    if layout == "panels" and not bf16_linear_ready():  # loads the panel op when this test runs first
        pytest.skip("the C++ kernels cannot be built here (the log says why)")
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    packed = to_panels(w) if layout == "panels" else torch.ops.mkldnn._reorder_linear_weight(w, None)
    torch.testing.assert_close(packed_linear(x, packed, b, 96), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a slice of a wider tensor) gives the same
    wide = torch.cat([x, x], dim=1)[:, :64]
    torch.testing.assert_close(packed_linear(wide, packed, b, 96), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compile", ["on", "off"])
def test_packed_greedy_matches_transformers_and_logprobs_match_unpacked(bf16_reference, compile):  # noqa: F811
    path, ids, expected = bf16_reference
    packed = LLM(path, compile=compile, prepack_weights="on", num_kv_blocks=128, progress=False, platform=FEW_ROWS)
    runner = packed.engine.runner
    linears = [m for m in runner.model.modules() if hasattr(m, "packed_weight")]
    assert linears and all(m.packed_weight.shape[2] == 16 for m in linears)  # panels: the kernel is built here
    assert runner.packed_weight_bytes > 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    together = packed.generate(ids, params, use_tqdm=False)  # batched decode: the packed GEMMs
    assert [o.outputs[0].token_ids for o in together] == expected
    plain = LLM(path, compile="off", prepack_weights="off", num_kv_blocks=128, progress=False, platform=FEW_ROWS)
    reference = plain.generate(ids, params, use_tqdm=False)
    for a, b in zip(together, reference, strict=True):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)


@torch.inference_mode()
def test_beside_panels_a_few_rows_layer_holds_its_weight_once_in_bf16(bf16_reference, compiled_llm,  # noqa: F811
                                                                      caplog):
    """compile on (a bf16 decode copy) and panels: each layer's weight is that copy itself, no
    float32 one beside the panels; every row count gives the bits the float32 weight gave (up
    to 16 rows from the copy, beyond from the panels), natively too, and steps of up to 16
    rows the logprobs of ``compiled_llm`` (float32 weights, no panels) exactly."""
    with caplog.at_level("INFO", logger="modserve"):
        packed = LLM(bf16_reference[0], compile="on", prepack_weights="on", num_kv_blocks=128, progress=False,
                     platform=FEW_ROWS)
    layers = float_layers(packed.engine.runner.model)
    g = torch.Generator().manual_seed(0)
    for m in layers:
        held = [t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if t.dim() == 2]  # not bias
        assert {t.dtype for t in held} == {torch.bfloat16}, [t.dtype for t in held]
        assert {t.data_ptr() for t in held} == {m.decode_weight.data_ptr()}  # the weight is the copy
        op, args = m.quantizer.native_op(m)
        for rows in (1, 5, 16, 17, 40):
            x = torch.randn(rows, m.weight.shape[1], generator=g)
            want = linear_or_gemv(x, m.weight.float(), m.bias, m.decode_weight, m.packed_weight)
            assert torch.equal(m.quantizer.apply(m, x), want), rows
            assert torch.equal(op_by_name(op)(x, *args), want), (op, rows)
    assert f"{len(layers)} of {len(layers)} layers hold their weight as their bf16 decode copy" in caplog.text
    assert _gemm_dtype(packed) == "float32"  # what bench headers and ceilings name: batches multiply panels
    prompts = [[11, 250, 37, 902, 14, 3], [7] * 5, [1200, 5, 5, 86]]  # a prefill of 15 rows, decodes of 3
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    ours, plain = (llm.generate(prompts, params, use_tqdm=False) for llm in (packed, compiled_llm))
    for a, b in zip(ours, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_prepack_auto_stays_off_for_small_models_and_says_why(bf16_reference, caplog):  # noqa: F811
    with caplog.at_level("INFO", logger="modserve"):
        llm = LLM(bf16_reference[0], num_kv_blocks=128, progress=False, platform=FEW_ROWS)
    assert not any(hasattr(m, "packed_weight") for m in llm.engine.runner.model.modules())
    assert "prepack_weights auto: off" in caplog.text and "MiB of weights" in caplog.text


def test_prepack_on_where_it_cannot_work_names_the_reason():
    path = str(cached_checkpoint("llama", "tiny"))
    with pytest.raises(ValueError, match="prepack_weights: on, but packed GEMMs are float32; this model "
                                         "computes in bfloat16"):
        LLM(path, dtype="bfloat16", prepack_weights="on", num_kv_blocks=64, progress=False)
