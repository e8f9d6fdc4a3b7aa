"""On a CUDA GPU: the engine against transformers, the AWQ Triton kernel, fp8 matmuls and caches,
swap preemption through pinned host memory, and guided decoding's bitmask on the device.

CI has no GPU, so these skip there; run them where one is lent: ``pytest tests/test_cuda.py``.
The same paths on CPU are covered by the other modules (the Triton kernel in its interpreter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.structured_outputs import StructuredOutputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "café naïve 日本語 😀 and then",
           "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
           "def step(self):\n    return self.queue.pop()\n" * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def make_llm(path: str, **kw) -> LLM:
    return LLM(path, **{"device": "cuda", "dtype": "float32", "num_kv_blocks": 256, "progress": False, **kw})


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def hf_cuda(llama_dir):
    """transformers on the GPU, float32 without TF32: greedy continuations and prefill logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert not torch.backends.cuda.matmul.allow_tf32  # the oracle's products are true float32
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).to("cuda").eval()
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    outs, logits = [], []
    with torch.no_grad():
        for p in ids:
            x = torch.tensor([p], device="cuda")
            gen = model.generate(x, max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
            logits.append(model(x).logits[0].float().cpu())
    return ids, outs, logits


@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_greedy_on_the_gpu_matches_transformers(llama_dir, hf_cuda, backend):
    from test_quantization import logit_error, prefill_logits

    ids, want, want_logits = hf_cuda
    llm = make_llm(llama_dir, attention_backend=backend)
    assert llm.engine.runner.kv_caches[0].is_cuda
    assert tokens(llm.generate(ids, GREEDY, use_tqdm=False)) == want
    max_abs, _ = logit_error([g.cpu() for g in prefill_logits(llm, ids)], want_logits)
    assert max_abs < 1e-4, max_abs


@pytest.mark.parametrize("backend", ["reference", "paged"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_on_the_gpu_stays_near_float32(llama_dir, hf_cuda, dtype, backend):
    from test_quantization import logit_error, prefill_logits

    ids, want, want_logits = hf_cuda
    llm = make_llm(llama_dir, dtype=dtype, attention_backend=backend)
    max_abs, kl = logit_error([g.float().cpu() for g in prefill_logits(llm, ids)], want_logits)
    assert max_abs < 0.15 and kl < 2e-3, (max_abs, kl)
    got = tokens(llm.generate(ids, GREEDY, use_tqdm=False))  # decodes read 16-bit KV back
    assert [t[0] for t in got] == [t[0] for t in want] and all(len(t) == GREEDY.max_tokens for t in got)


def test_chunked_prefill_and_prefix_caching_on_the_gpu(llama_dir, hf_cuda):
    ids, want, _ = hf_cuda
    llm = make_llm(llama_dir, max_num_batched_tokens=16,
                   kv_allocator={"name": "paged", "options": {"enable_prefix_caching": True}})
    assert tokens(llm.generate(ids, GREEDY, use_tqdm=False)) == want
    assert tokens(llm.generate(ids, GREEDY, use_tqdm=False)) == want  # now from cached blocks
    assert llm.engine.stats()["allocator_prefix_hit_tokens"] > 0


def test_swap_preemption_through_pinned_host_memory(llama_dir):
    prompts = [f"prompt {i}: " + "the model token cache " * (3 + i) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in range(6)]
    roomy = make_llm(llama_dir)
    expected = [tokens(roomy.generate(prompts, p, use_tqdm=False)) for p in (greedy, seeded)]
    llm = make_llm(llama_dir, num_kv_blocks=12, max_model_len=192, preemption_mode="swap", num_swap_blocks=64)
    assert llm.engine.runner.host_caches[0].is_pinned()
    assert [tokens(llm.generate(prompts, p, use_tqdm=False)) for p in (greedy, seeded)] == expected
    stats = llm.engine.stats()
    assert stats["preemptions_swap"] > 0 and stats["blocks_swapped_in"] == stats["blocks_swapped_out"]


def test_awq_triton_kernel_on_the_gpu():
    from test_quantization import ref_awq

    from modserve.quantizers.awq_triton import awq_gemm
    from modserve.testing import AWQ_PACK_ORDER, awq_quantize, pack_int32

    group_size, n, k = 128, 1000, 1024  # N leaves a partial tile
    gen = torch.Generator().manual_seed(0)
    q, zeros, scales = awq_quantize(torch.randn(n, k, generator=gen) * 0.05, group_size)
    qweight, qzeros = pack_int32(q, 4, 1, AWQ_PACK_ORDER), pack_int32(zeros, 4, 1, AWQ_PACK_ORDER)
    w = ref_awq(qweight, qzeros, scales, group_size)  # [N, K] float32
    packed = [t.cuda() for t in (qweight, qzeros, scales)]
    for m in (1, 7, 64, 300):
        x = torch.randn(m, k, generator=gen)
        for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
            xd = x.to(dtype)
            y = awq_gemm(xd.cuda(), *packed, group_size)
            want = xd.float() @ w.t().to(dtype).float()  # the kernel's own rounding of W, then exact sums
            assert y.dtype == dtype and y.shape == (m, n)
            torch.testing.assert_close(y.float().cpu(), want, rtol=tol, atol=tol, msg=f"{dtype} m={m}")


def test_awq_and_fp8_checkpoints_pick_the_gpu_kernels(llama_dir, hf_cuda):
    """On the GPU ``auto`` takes the Triton AWQ kernel and fp8's scaled matmul (row-wise
    scales need compute capability 9.0); their logits stay near the dequantizing path's."""
    from test_quantization import logit_error, prefill_logits

    from modserve.runner.linear import Linear
    from modserve.testing import cached_quantized_checkpoint

    ids = hf_cuda[0]
    awq_dir = str(cached_quantized_checkpoint("awq", cache_dir=Path(llama_dir).parent))  # beside the float one
    cases = [(awq_dir, "awq", "triton", 0.05, "float16")]
    if torch.cuda.get_device_capability() >= (9, 0):
        cases.append((llama_dir, "fp8", "scaled_mm", 0.3, "bfloat16"))
    for path, method, kernel, tol, dtype in cases:
        fast = make_llm(path, dtype=dtype, quantization=method)
        kernels = {m.kernel for m in fast.engine.runner.model.modules() if isinstance(m, Linear) and m.quantizer}
        assert kernels == {kernel}, (method, kernels)
        slow = make_llm(path, dtype=dtype, quantization={"name": method, "options": {"kernel": "dequant"}})
        max_abs, _ = logit_error([g.float().cpu() for g in prefill_logits(fast, ids)],
                                 [g.float().cpu() for g in prefill_logits(slow, ids)])
        assert max_abs < tol, (method, max_abs)
        assert all(len(t) == GREEDY.max_tokens for t in tokens(fast.generate(ids, GREEDY, use_tqdm=False)))


def test_fp8_kv_cache_on_the_gpu(llama_dir, hf_cuda):
    from test_quantization import logit_error, prefill_logits

    ids, _, want_logits = hf_cuda
    got = {}
    for backend in ("reference", "paged"):
        llm = make_llm(llama_dir, attention_backend=backend, kv_cache_dtype="fp8_e4m3")
        assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        got[backend] = tokens(llm.generate(ids, GREEDY, use_tqdm=False))
        max_abs, kl = logit_error([g.cpu() for g in prefill_logits(llm, ids)], want_logits)
        assert max_abs < 0.1 and kl < 1e-3, (backend, max_abs, kl)
    assert got["paged"] == got["reference"]


@pytest.mark.parametrize("grammar_backend", ["xgrammar", "outlines"])
def test_guided_choice_on_the_gpu(llama_dir, grammar_backend):
    llm = make_llm(llama_dir, grammar_backend=grammar_backend)
    choices = ["yes", "no", "it depends", "日本"]
    params = SamplingParams(n=6, temperature=1.0, seed=0, max_tokens=32,
                            structured_outputs=StructuredOutputs(choice=choices))
    out, = llm.generate("Pick:", params, use_tqdm=False)
    assert all(c.finish_reason == "stop" and c.text in choices for c in out.outputs)


# -- the triton backend and CUDA graphs of decode steps ---------------------------------------
BACKENDS = ("reference", "paged", "triton")


def graph_runner(llm: LLM):
    """What runs each step's forward: DecodeGraphs when decode steps replay CUDA graphs, else
    the runner's own eager forward."""
    return llm.engine.runner.step_forward


def captures(llm: LLM) -> bool:
    return type(graph_runner(llm)).__name__ == "DecodeGraphs"


def test_triton_on_the_gpu_matches_reference_and_transformers(llama_dir, hf_cuda):
    from test_quantization import logit_error, prefill_logits

    ids, want, want_logits = hf_cuda
    reference = tokens(make_llm(llama_dir, attention_backend="reference").generate(ids, GREEDY, use_tqdm=False))
    llm = make_llm(llama_dir, attention_backend="triton")
    assert captures(llm)  # the default: decodes replay graphs
    assert tokens(llm.generate(ids, GREEDY, use_tqdm=False)) == reference == want
    max_abs, _ = logit_error([g.cpu() for g in prefill_logits(llm, ids)], want_logits)
    assert max_abs < 1e-4, max_abs  # its dots are IEEE float32, not TF32


def test_triton_in_bfloat16_on_the_gpu_stays_near_float32(llama_dir, hf_cuda):
    from test_quantization import logit_error, prefill_logits

    ids, want, want_logits = hf_cuda
    llm = make_llm(llama_dir, dtype="bfloat16", attention_backend="triton")
    max_abs, kl = logit_error([g.float().cpu() for g in prefill_logits(llm, ids)], want_logits)
    assert max_abs < 0.15 and kl < 2e-3, (max_abs, kl)
    got = tokens(llm.generate(ids, GREEDY, use_tqdm=False))  # decodes through the graphs, 16-bit KV
    assert [t[0] for t in got] == [t[0] for t in want] and all(len(t) == GREEDY.max_tokens for t in got)


def test_cuda_graphs_give_the_eager_tokens_also_for_padded_batches(llama_dir, hf_cuda):
    """Default graph sizes against none. 3 and 5 prompts decode padded to the graphs of 4 and 8,
    and as requests of different lengths finish, the batch shrinks through 4, 2 and 1."""
    ids = hf_cuda[0]
    graphed = make_llm(llama_dir, attention_backend="triton")
    eager = make_llm(llama_dir, attention_backend="triton", cuda_graph_sizes=[])
    assert captures(graphed) and graph_runner(eager) == eager.engine.runner._forward
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (16, 9, 12, 5, 14)]
    for n in (1, 3, 5):
        want = tokens(eager.generate(ids[:n], params[:n], use_tqdm=False))
        assert tokens(graphed.generate(ids[:n], params[:n], use_tqdm=False)) == want, f"{n} prompts"
    assert {1, 2, 4, 8} <= set(graph_runner(graphed).replays), graph_runner(graphed).replays


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_every_backend_and_graph_mode_give_the_same_tokens(llama_dir, hf_cuda, kv_cache_dtype):
    """reference, paged and triton, graphs on and off, in float32: the same greedy tokens, with
    an fp8 cache too (each backend writes the same e4m3 bits and reads them in float32). In 16
    bits their roundings differ and random-weight continuations drift apart, which is why 16-bit
    runs compare logits and first tokens (above). compile off and max_num_seqs 8 (graphs of 1,
    2, 4, 8) keep the 6 engines per case quick; only triton captures, paged and reference run
    eagerly whatever cuda_graph_sizes says."""
    ids = hf_cuda[0]
    got = {}
    for backend in BACKENDS:
        for graphs in (True, False):
            llm = make_llm(llama_dir, attention_backend=backend, kv_cache_dtype=kv_cache_dtype, compile="off",
                           max_num_seqs=8, cuda_graph_sizes=None if graphs else [])
            assert captures(llm) == (graphs and backend == "triton"), (backend, graphs)
            got[backend, graphs] = tokens(llm.generate(ids, GREEDY, use_tqdm=False))
    want = got["reference", False]
    assert all(t == want for t in got.values()), {key: t == want for key, t in got.items()}


def test_triton_decodes_replay_their_graph_and_paged_runs_eagerly(llama_dir, hf_cuda, caplog):
    import logging

    ids = hf_cuda[0]
    llm = make_llm(llama_dir, attention_backend="triton")
    graphs = graph_runner(llm)
    assert captures(llm), graphs
    assert graphs.sizes == [1, 2, 4, *range(8, 129, 8)]  # the defaults, up to max_num_seqs 128
    replays, eager_steps = dict(graphs.replays), graphs.eager_steps
    llm.generate(ids[:3], GREEDY, use_tqdm=False)
    # One prefill step, eager; then every decode step of the 3 sequences is the graph of 4.
    assert graphs.replays[4] - replays.get(4, 0) == GREEDY.max_tokens - 1, graphs.replays
    assert sum(graphs.replays.values()) - sum(replays.values()) == GREEDY.max_tokens - 1, graphs.replays
    assert graphs.eager_steps - eager_steps == 1
    with caplog.at_level(logging.INFO, logger="modserve"):
        paged = make_llm(llama_dir, attention_backend="paged")
    assert graph_runner(paged) == paged.engine.runner._forward
    assert "cuda graphs: off" in caplog.text and "cannot be captured" in caplog.text, caplog.text
    assert tokens(paged.generate(ids[:3], GREEDY, use_tqdm=False)) == hf_cuda[1][:3]
