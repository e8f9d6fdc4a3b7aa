"""Quantizers: exact dequantization, logits near the float model, selection, memory.

Every quantized layer is checked bit for bit against a reference dequantization of
the checkpoint written here (an independent unpacker; AutoAWQ's own packer and
dequantizer for AWQ when installed), then whole models against the float one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modserve import LLM, SamplingParams
from modserve.runner.batch import build_batch
from modserve.runner.linear import Linear
from modserve.runner.quantization import planned_weight_bytes
from modserve.core.sequence import Sequence
from modserve.testing import (
    AWQ_PACK_ORDER, awq_quantize, cached_checkpoint, cached_quantized_checkpoint, pack_int32,
)

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "café naïve 日本語 😀 and then",
           "def step(self):\n    return self.queue.pop()\n" * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARDS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
          "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
          "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
# name -> (checkpoint maker args, engine quantization); group size 32 fits the tiny model
METHODS = {
    "int8": (None, "int8"),
    "fp8": (None, "fp8"),
    "awq": (("awq", {}), "awq"),
    "gptq4": (("gptq", {}), "gptq"),
    "gptq4-act-order": (("gptq", {"desc_act": True}), "gptq"),
    "gptq8-v2": (("gptq", {"bits": 8, "checkpoint_format": "gptq_v2"}), "gptq"),
}
# int8's auto activations round a prefill's rows to bf16 on a CPU with AMX-BF16 (tested below):
# float32 ones keep every logit error the weights' own.
EXACT = {"int8": {"name": "int8", "options": {"activations": "float32"}}}
# Prefill logits vs the float model, tiny llama (logits ~N(0, 0.3)): max |diff| and mean KL
# per position. Measured values are in docs/quantization.md; these leave ~2x headroom.
TOLERANCE = {"int8": (0.06, 5e-5), "fp8": (0.3, 1e-3), "awq": (0.8, 6e-3), "gptq4": (1.0, 1e-2),
             "gptq4-act-order": (1.0, 1e-2), "gptq8-v2": (0.06, 5e-5)}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    return os.environ.get("MODSERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def float_dir(cache_root) -> str:
    return str(cached_checkpoint("llama", cache_dir=cache_root))


def model_dir(method: str, float_dir: str, cache_root: str) -> str:
    maker = METHODS[method][0]
    if maker is None:
        return float_dir
    return str(cached_quantized_checkpoint(maker[0], cache_dir=cache_root, **maker[1]))


def make_llm(path: str, quantization=None, **kw) -> LLM:
    return LLM(path, **{"dtype": "float32", "num_kv_blocks": 256, "quantization": quantization,
                        "progress": False, **kw})


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits for the prompts, prefilled together in one step."""
    eng, runner = llm.engine, llm.engine.runner
    seqs = [Sequence(i, f"r{i}", list(p), len(p), SamplingParams(), 0.0) for i, p in enumerate(prompts)]
    for s in seqs:
        assert eng.allocator.allocate(s, s.num_tokens)
    try:
        input_ids, meta = build_batch([s.token_ids for s in seqs], [0] * len(seqs),
                                      [s.block_ids for s in seqs], runner.block_size, runner.device)
        with torch.inference_mode():
            hidden = runner.model(input_ids, meta.positions, runner.kv_caches, meta, runner.attn.prepare(meta))
            return list(torch.split(runner.model.compute_logits(hidden), [len(p) for p in prompts]))
    finally:
        for s in seqs:
            eng.allocator.free(s)


def logit_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """(max |difference|, mean KL(want || got) per position)."""
    g, w = torch.cat(got), torch.cat(want)
    kl = torch.nn.functional.kl_div(g.log_softmax(-1), w.log_softmax(-1), log_target=True, reduction="none")
    return (g - w).abs().max().item(), kl.sum(-1).mean().item()


# -- reference dequantization, written from the format descriptions -------------------------
def ref_awq(qweight, qzeros, scales, group_size) -> torch.Tensor:  # [N, K]
    def unpack(packed):  # [R, C/8] -> [R, C]: nibble i of word c is channel 8c + AWQ_PACK_ORDER[i]
        out = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.int64)
        for i, channel in enumerate(AWQ_PACK_ORDER):
            out[:, channel::8] = (packed.long() >> (4 * i)) & 0xF
        return out

    q, z = unpack(qweight), unpack(qzeros).repeat_interleave(group_size, 0)
    return ((q - z) * scales.float().repeat_interleave(group_size, 0)).t()


def ref_gptq(qweight, qzeros, scales, g_idx, bits, zero_offset) -> torch.Tensor:  # [N, K]
    per, mask = 32 // bits, 2**bits - 1
    q = torch.empty(qweight.shape[0] * per, qweight.shape[1], dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], qzeros.shape[1] * per, dtype=torch.int64)
    for j in range(per):  # value j of a word is input row per * r + j (qweight), output column (qzeros)
        q[j::per] = (qweight.long() >> (bits * j)) & mask
        z[:, j::per] = (qzeros.long() >> (bits * j)) & mask
    g = g_idx.long()
    return ((q - (z[g] + zero_offset)) * scales.float()[g]).t()


def ref_weight(method: str, tensors: dict[str, torch.Tensor], module: str, qcfg: dict) -> torch.Tensor:
    if method in ("int8", "fp8"):
        w = tensors[f"{module}.weight"].float()
        if method == "int8":
            s = w.abs().amax(1) / 127
            return torch.round(w / s[:, None]).clamp(-127, 127) * s[:, None]
        s = w.abs().amax(1) / 448
        return (w / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s[:, None]
    qw, qz, sc = (tensors[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales"))
    if method == "awq":
        return ref_awq(qw, qz, sc, qcfg["group_size"])
    offset = 1 if qcfg["checkpoint_format"] == "gptq" else 0
    return ref_gptq(qw, qz, sc, tensors[f"{module}.g_idx"], qcfg["bits"], offset)


# Kernels that keep the weights in another layout (repacked at load) besides dequant.
REPACKED = {"int8": "int8pack", "awq": "int4pack", "gptq4": "int4pack", "gptq4-act-order": "int4pack"}


@pytest.mark.parametrize("method,kernel", [(m, "dequant") for m in METHODS] + list(REPACKED.items())
                         + [("int8", "cpu")])
def test_dequantized_weights_equal_the_reference_bit_for_bit(method, kernel, float_dir, cache_root):
    name = METHODS[method][1]
    path = model_dir(method, float_dir, cache_root)
    llm = make_llm(path, {"name": name, "options": {"kernel": kernel}})
    tensors = {k.removeprefix("model."): v for k, v in load_file(Path(path) / "model.safetensors").items()}
    qcfg = json.loads((Path(path) / "config.json").read_text()).get("quantization_config", {})
    model = llm.engine.runner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    checked = 0
    for layer in range(model.config.num_hidden_layers):
        for ckpt_name, (ours, shard) in SHARDS.items():
            kind = "self_attn" if ckpt_name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            linear = linears[f"layers.{layer}.{ours}"]
            assert linear.kernel == kernel
            start, size = linear.spec.shard_offset(shard), linear.spec.shard_sizes[shard]
            got = linear.quantizer.dequantize(linear)[start : start + size]
            want = ref_weight(name, tensors, f"layers.{layer}.{kind}.{ckpt_name}", qcfg)
            assert got.dtype == torch.float32 and torch.equal(got, want), f"layers.{layer} {ckpt_name}"
            checked += 1
    assert checked == 7 * model.config.num_hidden_layers


def test_awq_packing_matches_autoawq(monkeypatch):
    """AutoAWQ's WQLinear_GEMM.from_linear packs the same (q, zeros, scales) into the same
    int32 words as modserve.testing, and its dequantize_gemm agrees with the engine's."""
    gemm = pytest.importorskip("awq.modules.linear.gemm")
    from awq.utils.packing_utils import dequantize_gemm

    monkeypatch.setattr(gemm, "TRITON_AVAILABLE", False)
    group_size, n, k = 32, 96, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
    q, zeros, scales = awq_quantize(w, group_size)  # [K, N], [K/g, N], [K/g, N]
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():  # from_linear expects weights already on the grid
        linear.weight.copy_(((q - zeros.repeat_interleave(group_size, 0)) *
                             scales.float().repeat_interleave(group_size, 0)).t())
    ref = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales, zeros=zeros)
    qweight, qzeros = pack_int32(q, 4, 1, AWQ_PACK_ORDER), pack_int32(zeros, 4, 1, AWQ_PACK_ORDER)
    assert torch.equal(ref.qweight, qweight) and torch.equal(ref.qzeros, qzeros)
    assert torch.equal(ref.scales, scales)

    from modserve.core.contracts.quantizer import LinearSpec
    from modserve.quantizers.awq import AWQ

    quantizer = AWQ({"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm"})
    layer = Linear(LinearSpec(k, n, (n,), False, torch.float32, torch.device("cpu")), quantizer)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        layer.load(name, t)
    quantizer.process_weights(layer)
    theirs = dequantize_gemm(ref.qweight, ref.qzeros, ref.scales, 4, group_size)  # [K, N] float16
    assert torch.equal(quantizer.dequantize(layer).t().half(), theirs)


# -- whole models --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_reference(float_dir):
    llm = make_llm(float_dir)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    return ids, prefill_logits(llm, ids)


@pytest.mark.parametrize("method", list(METHODS))
def test_prefill_logits_near_the_float_model(method, float_dir, cache_root, float_reference):
    ids, want = float_reference
    llm = make_llm(model_dir(method, float_dir, cache_root), METHODS[method][1])
    max_abs, kl = logit_error(prefill_logits(llm, ids), want)
    tol_abs, tol_kl = TOLERANCE[method]
    assert max_abs < tol_abs and kl < tol_kl, f"{method}: max |diff| {max_abs:.4f}, KL {kl:.2e}"


@pytest.mark.parametrize("method", list(METHODS))
def test_the_quantized_model_is_the_float_model_with_dequantized_weights(method, float_dir, cache_root,
                                                                          float_reference):
    """All of the logit error is the weights' rounding: put each layer's dequantized weight
    into the float model and the logits agree to float error."""
    ids, _ = float_reference
    quantized = make_llm(model_dir(method, float_dir, cache_root), EXACT.get(method, METHODS[method][1]))
    patched = make_llm(float_dir)
    q_linears = dict(quantized.engine.runner.model.named_modules())
    with torch.no_grad():
        for name, linear in patched.engine.runner.model.named_modules():
            if isinstance(linear, Linear):
                q = q_linears[name]
                linear.weight.copy_(q.quantizer.dequantize(q))
                if linear.bias is not None:
                    linear.bias.copy_(q.bias)
    max_abs, _ = logit_error(prefill_logits(quantized, ids), prefill_logits(patched, ids))
    assert max_abs < 1e-4, f"{method}: {max_abs}"


@pytest.mark.parametrize("method,kernel", [("int8", "int8pack"), ("int8", "cpu"), ("awq", "int4pack"),
                                           ("gptq4", "int4pack"), ("gptq4-act-order", "int4pack"),
                                           ("fp8", "scaled_mm")])
def test_kernels_agree_with_dequantize_then_matmul(method, kernel, float_dir, cache_root, float_reference):
    """torch's int8/int4 CPU kernels (named: auto never picks them) and the fp8 scaled matmul (GPUs with
    fp8 tensor cores; torch also runs it on CPU) against the dequantizing path, forced here."""
    ids, _ = float_reference
    path, name = model_dir(method, float_dir, cache_root), METHODS[method][1]
    want = prefill_logits(make_llm(path, {"name": name, "options": {"kernel": "dequant"}}), ids)
    exact = {"activations": "float32"} if kernel == "cpu" else {}
    got = prefill_logits(make_llm(path, {"name": name, "options": {"kernel": kernel, **exact}}), ids)
    max_abs, _ = logit_error(got, want)
    # fp8 x fp8 also quantizes the activations (exactness: test_fp8_scaled_mm_is_the_fp8_product)
    assert max_abs < (TOLERANCE["fp8"][0] if kernel == "scaled_mm" else 1e-4), f"{method} {kernel}: {max_abs}"


@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_int8_activations_round_the_prefill_only(activations, float_dir, cache_root, float_reference):
    """``activations: int8`` (W8A8) and ``bf16`` (AMX tiles): a prompt of more than 16 tokens is
    prefilled with its rows rounded, within int8 rounding of the weight-only logits (and not
    equal to them); a decode step of up to 16 rows keeps float32 activations: the same logits
    bit for bit."""
    if activations == "bf16" and not _bf16_tiles():
        pytest.skip("this CPU has no AMX-BF16 tiles (torch's cpublas::could_pack(bfloat16) is false)")
    ids, float_logits = float_reference
    weight_only = make_llm(float_dir, EXACT["int8"])
    rounded = make_llm(float_dir, {"name": "int8", "options": {"activations": activations}})
    long_prompts = [p for p in ids if len(p) > 16]
    assert long_prompts, "the test's prompts must be longer than 16 tokens"
    got, want = prefill_logits(rounded, long_prompts), prefill_logits(weight_only, long_prompts)
    max_abs, kl = logit_error(got, want)
    assert 0 < max_abs < TOLERANCE["int8"][0] and kl < TOLERANCE["int8"][1], (max_abs, kl)
    short = [p[:8] for p in ids]  # 8 rows or fewer per prompt, prefilled one prompt at a time
    for p in short:
        assert torch.equal(prefill_logits(rounded, [p])[0], prefill_logits(weight_only, [p])[0])


def _bf16_tiles() -> bool:
    from modserve.quantizers.int8 import load_cpu_kernel

    assert load_cpu_kernel() is None
    return bool(torch.ops.modserve_int8.bf16_tiles())


def test_int8_auto_activations_are_bf16_where_the_cpu_has_tiles(float_dir):
    llm = make_llm(float_dir, "int8")
    linear = next(m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and hasattr(m, "qweight"))
    assert linear.quantizer.cpu_op() == ("linear_bf16" if _bf16_tiles() else "linear")


@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_int8_activations_need_the_cpu_kernel(activations, float_dir):
    with pytest.raises(ValueError, match=f"activations: {activations} needs the cpu kernel.*would run dequant"):
        make_llm(float_dir, {"name": "int8", "options": {"kernel": "dequant", "activations": activations}})


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 64])
def test_int8_cpu_kernel_is_the_scaled_int8_product(rows):
    """``int8`` kernel ``cpu`` (auto's choice on a CPU): up to 16 rows read the int8 weights in
    C++, more read them in blocks that stay in cache; both give (x @ q.T) * s + b. K = 200 is no multiple of the
    vector width and N = 300 none of a thread's claim, so every tail runs."""
    from modserve.quantizers.int8 import load_cpu_kernel

    assert load_cpu_kernel() is None
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (300, 200), dtype=torch.int8, generator=g)
    s, b, x = torch.rand(300, generator=g) / 50, torch.randn(300, generator=g), torch.randn(rows, 200, generator=g)
    want = (x.double() @ q.double().T) * s.double() + b.double()
    for bias in (b, None):
        got = torch.ops.modserve_int8.linear(x, q, s, bias)
        assert got.shape == (rows, 300) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want if bias is not None else want - b.double(),
                                   atol=1e-4, rtol=1e-5)


def test_fp8_scaled_mm_is_the_fp8_product():
    from modserve.core.contracts.quantizer import LinearSpec
    from modserve.quantizers.fp8 import FP8Options, FP8Weights

    gen = torch.Generator().manual_seed(0)
    quantizer = FP8Weights(options=FP8Options(kernel="scaled_mm"))
    layer = Linear(LinearSpec(64, 96, (64, 32), True, torch.float32, torch.device("cpu")), quantizer)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer.load("weight", w[:64], 0)
    layer.load("weight", w[64:], 1)
    layer.load("bias", b[:64], 0)
    layer.load("bias", b[64:], 1)
    quantizer.process_weights(layer)
    x = torch.randn(5, 64, generator=gen)
    a = x.abs().amax(1, keepdim=True) / 448  # per-token activation scale
    x_fp8 = (x / a).to(torch.float8_e4m3fn).float() * a
    want = x_fp8 @ quantizer.dequantize(layer).t() + b
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_text_end_to_end(method, float_dir, cache_root):
    llm = make_llm(model_dir(method, float_dir, cache_root), METHODS[method][1], kv_cache_dtype="fp8_e4m3")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].text for o in outs)
    # the same tokens one at a time: a batch's composition does not change greedy output
    alone = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids


# -- selection -------------------------------------------------------------------------------
def _with_quant_config(src: str, dst: Path, quant_config: dict | None) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    if quant_config is None:
        del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_the_checkpoint_selects_its_quantizer_and_a_compatible_config_agrees(float_dir, cache_root):
    path = model_dir("awq", float_dir, cache_root)
    for choice in (None, "awq"):
        runner = make_llm(path, choice).engine.runner
        assert type(runner.quantizer).__name__ == "AWQ" and runner.quantizer.group_size == 32


def test_a_mismatch_names_both(float_dir, cache_root):
    with pytest.raises(ValueError, match=r"quantization 'int8' \(config\).*quant_method 'awq'"):
        make_llm(model_dir("awq", float_dir, cache_root), "int8")
    with pytest.raises(ValueError, match=r"quantization 'gptq'.*no quantization_config"):
        make_llm(float_dir, "gptq")


def test_an_unknown_quant_method_lists_the_quantizers(float_dir, tmp_path):
    path = _with_quant_config(float_dir, tmp_path / "m", {"quant_method": "bitsandbytes", "bits": 4})
    with pytest.raises(ValueError, match=r"quant_method 'bitsandbytes'.*available: awq, fp8, gptq, int8"):
        make_llm(path)


def test_embeddings_and_lm_head_stay_float(float_dir):
    model = make_llm(float_dir, "int8").engine.runner.model
    assert model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32
    assert not isinstance(model.lm_head, Linear)


# -- fp8 KV cache -----------------------------------------------------------------------------
def test_fp8_kv_cache_paged_equals_reference_and_stays_near_float(float_dir, float_reference):
    ids, want = float_reference
    got = {}
    for backend in ("reference", "paged"):
        llm = make_llm(float_dir, attention_backend=backend, kv_cache_dtype="fp8_e4m3")
        runner = llm.engine.runner
        assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
        runner.attn_spec.k_scale, runner.attn_spec.v_scale = 0.02, 0.01  # as if from the checkpoint
        got[backend] = prefill_logits(llm, ids)
        # decode steps read everything back from the cache
        got[backend + " decode"] = [o.outputs[0].token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    assert logit_error(got["paged"], got["reference"])[0] < 1e-4
    assert got["paged decode"] == got["reference decode"]
    max_abs, kl = logit_error(got["paged"], want)
    assert max_abs < 0.1 and kl < 1e-3, (max_abs, kl)


def test_kv_scales_come_from_the_checkpoint(float_dir, tmp_path):
    path = _with_quant_config(float_dir, tmp_path / "m", None)
    scales = {f"model.layers.{i}.self_attn.{n}": torch.tensor(v) for i in range(2)
              for n, v in (("k_scale", 0.01 * (i + 1)), ("v_scale", 0.005))}
    save_file(scales, str(Path(path) / "kv_scales.safetensors"))
    spec = make_llm(path, kv_cache_dtype="fp8_e4m3").engine.runner.attn_spec
    assert (spec.k_scale, spec.v_scale) == pytest.approx((0.02, 0.005))
    assert make_llm(path).engine.runner.attn_spec.k_scale == 1.0  # a float cache ignores them


def test_a_backend_that_cannot_read_fp8_refuses_with_its_reason(float_dir):
    from modserve.attention_backends.reference import ReferenceAttention
    from modserve.core.hookspecs import hookimpl
    from modserve.core.contracts.attention_backend import AttentionBackend
    from modserve.core.registry import get_registry

    class FloatOnly(ReferenceAttention):
        kv_cache_problem = AttentionBackend.kv_cache_problem  # the default: compute dtype only

    class Plugin:
        @hookimpl
        def register_attention_backends(self, register):
            register("float-only", lambda: FloatOnly)

    registry = get_registry()
    with registry.plugin(Plugin(), "float-only"):
        with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3: attention backend 'float-only' "
                                             "cannot use it: FloatOnly reads only a KV cache in the compute"):
            make_llm(float_dir, attention_backend="float-only", kv_cache_dtype="fp8_e4m3")
        make_llm(float_dir, attention_backend="float-only")  # a float cache is fine


# -- memory ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", list(METHODS))
def test_planned_weight_bytes_equal_what_the_engine_allocated(method, float_dir, cache_root):
    path, name = model_dir(method, float_dir, cache_root), METHODS[method][1]
    llm = make_llm(path, name)
    assert planned_weight_bytes(path, name, torch.float32) == llm.engine.runner.weight_bytes
    if method in REPACKED:
        choice = {"name": name, "options": {"kernel": REPACKED[method]}}
        llm = make_llm(path, choice)
        assert planned_weight_bytes(path, choice, torch.float32) == llm.engine.runner.weight_bytes


def test_plan_reports_weights_and_kv_tokens_the_engine_allocates(float_dir, cache_root):
    from modserve.bench.plan import Hardware, ModelShape, plan

    shape = ModelShape.load(float_dir)
    float32 = planned_weight_bytes(float_dir, None, torch.float32)
    bf16 = planned_weight_bytes(float_dir, None, torch.bfloat16)
    assert float32 == 2 * bf16 == shape.num_params * 4
    for method in ("int8", "awq"):
        assert planned_weight_bytes(model_dir(method, float_dir, cache_root), METHODS[method][1],
                                    torch.float32) < 0.95 * float32  # embeddings dominate the tiny model
    kv_gib = 2**-7  # 8 MiB: whole blocks of either dtype
    for kv_cache_dtype, plan_dtype in (("auto", "float32"), ("fp8_e4m3", "fp8")):
        llm = make_llm(float_dir, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=None, kv_cache_memory_gb=kv_gib)
        eng = llm.engine
        hw = Hardware("test", float32 + kv_gib * 2**30, 1e9, 1e12, None, 1e12)
        p = plan(shape, hw, "float32", plan_dtype, memory_fraction=1.0, weight_bytes=float32)
        assert p.kv_bytes_per_token == eng.runner.kv_bytes_per_block() / eng.config.block_size
        tokens = eng.num_blocks * eng.config.block_size
        assert tokens <= p.kv_tokens < tokens + eng.config.block_size
        assert eng.stats()["kv_cache_bytes"] == eng.num_blocks * eng.runner.kv_bytes_per_block()
        if kv_cache_dtype == "auto":
            float_tokens = tokens
    assert tokens == 4 * float_tokens  # fp8 holds 4x the float32 tokens in the same memory


def test_modserve_plan_cli_quantization(float_dir, cache_root, capsys):
    from modserve.cli import main

    path = model_dir("awq", float_dir, cache_root)
    assert main(["plan", "--model", path, "--hardware", "h100", "--dtype", "bfloat16",
                 "--quantization", "awq", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weight_bytes"] == planned_weight_bytes(path, "awq", torch.bfloat16, device="cuda")
    assert out["quantization"] == "awq"


# -- the Triton kernel, in Triton's interpreter ----------------------------------------------
TRITON_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_quantization import AWQ_PACK_ORDER, awq_quantize, pack_int32, ref_awq
from modserve.quantizers.awq_triton import awq_gemm
group_size, n, k = 32, 96, 128
for m in (1, 5, 70):
    gen = torch.Generator().manual_seed(m)
    q, zeros, scales = awq_quantize(torch.randn(n, k, generator=gen) * 0.05, group_size)
    qweight, qzeros = pack_int32(q, 4, 1, AWQ_PACK_ORDER), pack_int32(zeros, 4, 1, AWQ_PACK_ORDER)
    x = torch.randn(m, k, generator=gen)
    y = awq_gemm(x, qweight, qzeros, scales, group_size)  # [M, N]
    want = x @ ref_awq(qweight, qzeros, scales, group_size).t()
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_awq_triton_gemm_in_the_interpreter():
    """The GPU kernel on CPU tensors under TRITON_INTERPRET=1, which must be set before triton
    is first imported (hence a fresh process), on tiny shapes against the reference
    dequantization: N=96 leaves a partial tile, K=128 is four groups of 32, M=70 two row tiles."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK, str(Path(__file__).parent)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# -- the server -------------------------------------------------------------------------------
def test_modserve_serve_quantization_int8(float_dir, tmp_path):
    """`modserve serve --quantization int8 --kv-cache-dtype fp8_e4m3` answers greedy requests
    with the text the offline engine gives for the same config."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = ["--model", float_dir, "--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3",
             "--num-kv-blocks", "256", "--served-model-name", "q"]
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "modserve", "serve", "--port", str(port), *flags],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"model": "q", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        offline = make_llm(float_dir, "int8", kv_cache_dtype="fp8_e4m3").generate(PROMPTS[1], GREEDY, use_tqdm=False)
        assert served == offline[0].outputs[0].text
        assert "Int8" in log.read_text() and "float8_e4m3fn" in log.read_text()  # what it loaded, logged
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
