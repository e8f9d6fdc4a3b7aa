"""Benchmarks, A/B comparison and the capacity planner: the arithmetic by hand, the commands end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from modserve.bench import metrics, plan, serve_client, workloads
from modserve.bench.metrics import RequestResult
from modserve.bench.workloads import BenchRequest
from modserve.cli import main
from modserve.core.hookspecs import hookimpl
from modserve.core.registry import get_registry
from server_process import launch, stop, wait_healthy

POOL = np.arange(3, 4096)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """--threads sets torch's process-wide thread count; later tests get theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# -- workloads ----------------------------------------------------------------------------
def test_random_workload_is_deterministic_and_in_range():
    a = workloads.random_requests(32, 100, 20, POOL, range_ratio=0.5, prefix_len=10, seed=1)
    assert a == workloads.random_requests(32, 100, 20, POOL, range_ratio=0.5, prefix_len=10, seed=1)
    assert a != workloads.random_requests(32, 100, 20, POOL, range_ratio=0.5, prefix_len=10, seed=2)
    assert all(10 + 50 <= r.prompt_len <= 10 + 150 and 10 <= r.output_len <= 30 for r in a)
    assert len({tuple(r.prompt_token_ids[:10]) for r in a}) == 1  # the shared prefix
    assert len({r.prompt_len for r in a}) > 1
    fixed = workloads.random_requests(4, 7, 3, POOL)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(7, 3)] * 4


def test_prefix_repetition_reuses_each_prefix():
    reqs = workloads.prefix_repetition_requests(12, 8, 4, 3, 5, POOL, seed=0)
    assert reqs == workloads.prefix_repetition_requests(12, 8, 4, 3, 5, POOL, seed=0)
    prefixes = [tuple(r.prompt_token_ids[:8]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert all(r.prompt_len == 12 and r.output_len == 5 for r in reqs)


def test_multi_turn_chats_grow_turn_by_turn():
    reqs = workloads.multi_turn_requests(12, 5, 3, 4, POOL, prefix_len=6, seed=0)  # 3 chats of 4 turns
    assert reqs == workloads.multi_turn_requests(12, 5, 3, 4, POOL, prefix_len=6, seed=0)
    assert [r.prompt_len for r in reqs] == [6 + 5] * 3 + [6 + 5 + 8] * 3 + [6 + 5 + 16] * 3 + [6 + 5 + 24] * 3
    for chat in range(3):
        turns = [reqs[t * 3 + chat].prompt_token_ids for t in range(4)]
        assert all(later[:len(earlier)] == earlier for earlier, later in zip(turns, turns[1:]))  # each extends the last
    assert len({tuple(r.prompt_token_ids[:6]) for r in reqs}) == 1  # the system prompt
    assert len({tuple(r.prompt_token_ids[:11]) for r in reqs}) == 3  # three chats
    assert all(r.output_len == 3 for r in reqs)


def test_few_shot_prompts_branch_at_each_example():
    reqs = workloads.few_shot_requests(64, 4, 2, 3, POOL, num_shots=3, branching=2, prefix_len=5, seed=0)
    assert all(r.prompt_len == 5 + 3 * 4 + 2 for r in reqs)
    for depth, paths in ((5, 1), (5 + 4, 2), (5 + 8, 4), (5 + 12, 8)):  # the tree: 1, 2, 4 then 8 prefixes
        assert len({tuple(r.prompt_token_ids[:depth]) for r in reqs}) == paths
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 64  # every question its own


def test_file_workloads(tmp_path, llama_dir):
    custom = tmp_path / "w.jsonl"
    custom.write_text('{"prompt": "hi there", "output_tokens": 3}\n\n'
                      '{"prompt_token_ids": [5, 6, 7], "output_len": 2}\n')
    assert workloads.custom_requests(custom) == [BenchRequest("hi there", None, 3), BenchRequest(None, [5, 6, 7], 2)]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    convs = [{"conversations": [{"from": "human", "value": f"question {i}"},
                                {"from": "gpt", "value": "answer " * (i + 1)}]} for i in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "no reply"}]})
    share = tmp_path / "sg.json"
    share.write_text(json.dumps(convs))
    reqs = workloads.sharegpt_requests(share, 10, seed=3, tokenizer=tok)
    assert len(reqs) == 6 and reqs == workloads.sharegpt_requests(share, 10, seed=3, tokenizer=tok)
    for r in reqs:  # the reply's token count is the output length
        i = int(r.prompt.split()[1])
        assert r.output_len == len(tok.encode("answer " * (i + 1), add_special_tokens=False))
    assert len(workloads.sharegpt_requests(share, 10, output_len=4)) == 7

    default = workloads.custom_requests(workloads.DEFAULT_WORKLOAD)
    assert len(default) == 128 and all(r.prompt and 4 <= r.output_len <= 128 for r in default)


# -- metrics ---------------------------------------------------------------------------------
def test_percentiles_and_summary():
    values = [float(x) for x in range(1, 11)]  # 1..10
    assert metrics.percentile(values, 50) == 5.5
    assert metrics.percentile(values, 90) == pytest.approx(9.1)  # 9 + 0.1 * (10 - 9)
    assert metrics.percentile(values, 99) == pytest.approx(9.91)
    assert math.isnan(metrics.percentile([], 50))
    s = metrics.Summary.of([0.010, 0.020, 0.030, 0.100])
    assert s.ms() == pytest.approx({"mean": 40.0, "median": 25.0, "p90": 79.0, "p99": 97.9})
    spread = metrics.Spread.of([3.0, 1.0, 2.0])
    assert (spread.median, spread.lo, spread.hi) == (2.0, 1.0, 3.0)
    assert spread.format() == "2.0 [1.0-3.0]"
    assert metrics.ratio_spread([2.0, 3.0], [1.0, 2.0]) == metrics.Spread(1.75, 1.5, 2.0)


def test_tpot_and_goodput_by_hand():
    results = [
        RequestResult(10, 11, ttft=0.100, e2el=0.600),  # tpot 50 ms
        RequestResult(10, 5, ttft=0.300, e2el=0.500),  # tpot 50 ms, ttft too slow
        RequestResult(10, 3, ttft=0.050, e2el=0.450),  # tpot 200 ms
        RequestResult(10, 1, ttft=0.080, e2el=0.080),  # one token: tpot 0
        RequestResult(10, 0, success=False, error="HTTP 500"),
    ]
    assert [r.tpot for r in results[:4]] == pytest.approx([0.05, 0.05, 0.2, 0.0])
    slos = metrics.parse_slos(["ttft:200", "tpot:60"])
    assert slos == {"ttft": 0.2, "tpot": 0.06}
    assert metrics.goodput(results, slos, duration=2.0) == 1.0  # requests 0 and 3 over 2 s
    assert metrics.goodput(results, metrics.parse_slos(["e2el:500"]), duration=4.0) == 0.75
    assert metrics.goodput(results, {}, duration=1.0) == 4  # no SLO: every success counts
    for bad in ("ttft", "speed:10", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="goodput SLO"):
            metrics.parse_slos([bad])


def test_arrival_gaps_rate_and_burstiness():
    poisson = serve_client.arrival_gaps(20000, 4.0, 1.0, seed=0)
    bursty = serve_client.arrival_gaps(20000, 4.0, 0.25, seed=0)
    assert poisson.mean() == pytest.approx(0.25, rel=0.03) and bursty.mean() == pytest.approx(0.25, rel=0.05)
    # a gamma of shape k has coefficient of variation 1 / sqrt(k)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)
    assert (serve_client.arrival_gaps(5, math.inf, 1.0, 0) == 0).all()
    assert (serve_client.arrival_gaps(5, 2.0, 1.0, 7) == serve_client.arrival_gaps(5, 2.0, 1.0, 7)).all()


# -- plan ---------------------------------------------------------------------------------------
LLAMA3_70B = Path(__file__).parent.parent / "configs" / "shapes" / "llama-3-70b.json"


def test_plan_llama3_70b_by_hand(capsys):
    shape = plan.ModelShape.load(LLAMA3_70B)  # 80 layers, 8 KV heads, 64 heads of 128, bf16
    assert shape.head_dim == 128
    per_layer = 8192 * 8192 * 2 + 8192 * 1024 * 2 + 3 * 8192 * 28672 + 2 * 8192
    params = 80 * per_layer + 2 * 128256 * 8192 + 8192
    assert shape.num_params == params  # 70.55 B

    p = plan.plan(shape, plan.HARDWARE["h100"], dtype="fp8", kv_dtype="bfloat16")
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert p.weight_bytes == params
    assert p.decode_ceiling_tok_s == pytest.approx(3.35e12 / params) and 47 < p.decode_ceiling_tok_s < 49
    assert p.kv_tokens == int((80e9 * 0.9 - params) // (320 * 1024))
    # decode turns compute-bound where 2 P B / F = W / BW: B = F * bytes-per-weight / (2 BW)
    assert p.compute_bound_batch == pytest.approx(1979e12 * 1 / (2 * 3.35e12))
    assert p.prefill_s_per_1k == pytest.approx((2 * params * 1000 + 2 * 80 * 64 * 128 * 1000**2) / 1979e12)

    tp8 = plan.plan(shape, plan.HARDWARE["h100"], dtype="bfloat16", tp=8, context_len=8192)
    assert tp8.kv_bytes_per_token == 320 * 1024 / 8 and tp8.weight_bytes == params * 2 / 8
    assert tp8.decode_ceiling_tok_s == pytest.approx(3.35e12 / (params * 2 / 8 + 8192 * 40 * 1024))
    assert math.isinf(tp8.compute_bound_batch)  # at 8k context the KV reads outgrow the math

    assert main(["plan", "--model", str(LLAMA3_70B), "--hardware", "h100", "--dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 327680 and round(out["decode_ceiling_tok_s"]) == 47


SHAPES = Path(__file__).parent.parent / "configs" / "shapes"


def test_plan_piped_into_a_reader_that_leaves_ends_without_a_traceback():
    """`modserve plan ... | head -1`: the reader is gone before plan writes."""
    proc = subprocess.Popen([sys.executable, "-m", "modserve.cli", "plan", "--model", str(SHAPES / "mixtral-8x7b.json"),
                             "--hardware", "h200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the interpreter has even imported modserve
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


def test_plan_moe_by_hand(capsys):
    """Mixtral-8x7B: 46.7 B parameters, 12.9 B active (Mistral AI's figures); Qwen1.5-MoE-A2.7B:
    14.3 B and 2.7 B with its shared expert (Qwen's)."""
    shape = plan.ModelShape.load(SHAPES / "mixtral-8x7b.json")
    attn = 4096 * 4096 * 2 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    embeddings, norms = 2 * 32000 * 4096, 2 * 4096
    assert shape.num_params == 32 * (attn + 4096 * 8 + 8 * expert + norms) + embeddings + 4096
    assert shape.active_params == 32 * (attn + 4096 * 8 + 2 * expert + norms) + embeddings + 4096
    assert round(shape.num_params / 1e8) == 467 and round(shape.active_params / 1e8) == 129
    # experts hit by a batch of B: 8 (1 - (6/8)^B); under half an expert idle from B = 10
    assert shape.experts_hit(1) == pytest.approx(2) and shape.experts_hit(9) == pytest.approx(8 * (1 - 0.75**9))
    assert 8 * 0.75**9 > 0.5 > 8 * 0.75**10 and shape.all_experts_batch == 10

    p = plan.plan(shape, plan.HARDWARE["h200"], dtype="bfloat16")
    assert p.weight_bytes == shape.num_params * 2  # every expert is held
    assert p.active_weight_bytes == pytest.approx(shape.active_params * 2)  # one token reads its two
    assert p.decode_ceiling_tok_s == pytest.approx(4.8e12 / (shape.active_params * 2))

    qwen = plan.ModelShape.load(SHAPES / "qwen1.5-moe-a2.7b.json")
    assert round(qwen.num_params / 1e8) == 143 and round(qwen.active_params / 1e8) == 27
    assert main(["plan", "--model", str(SHAPES / "qwen1.5-moe-a2.7b.json"), "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "60 experts, top 4, in 24 of 24 layers, a shared expert: 2.689 B active of 14.316 B" in out
    assert "every expert    hit from batch 70" in out

    dense = plan.ModelShape.load(LLAMA3_70B)
    assert dense.active_params == dense.num_params and plan.plan(dense, plan.HARDWARE["h100"]).experts is None


def test_plan_disaggregated_pools_by_hand(capsys):
    """Llama-3-70B in fp8 on one H200 per instance, 2000-token prompts, 200-token answers, decode
    batch 32, 40 req/s."""
    shape = plan.ModelShape.load(LLAMA3_70B)
    p = plan.plan(shape, plan.HARDWARE["h200"], dtype="fp8", kv_dtype="bfloat16")
    params, kv = shape.num_params, 2 * 80 * 8 * 128 * 2  # 70.55 B weights of 1 byte, 320 KiB
    d = plan.disaggregation(shape, p, plan.INTERCONNECTS["ib-ndr400"], 2000, 200, batch=32, request_rate=40)
    # prefill: compute-bound, 2 P N + 2 L H d N^2 = 282.2 + 5.2 TFLOP at 1979 TFLOP/s = 145.3 ms
    flops = 2 * params * 2000 + 2 * 80 * 64 * 128 * 2000**2
    assert d.prefill_flops == flops and d.prefill_s == pytest.approx(flops / 1979e12)
    assert 0.145 < d.prefill_s < 0.146
    # decode: bandwidth-bound at batch 32, mean context 2000 + 200 / 2: (W + 32 x 2100 x kv) / BW = 19.29 ms
    step = (params + 32 * 2100 * kv) / 4.8e12
    assert d.decode_context == 2100 and d.decode_step_s == pytest.approx(step) and 0.0192 < step < 0.0193
    assert d.decode_s == pytest.approx(200 * step / 32)  # 0.1205 instance-s: the step is shared by 32
    # pools: 40 x 0.1453 = 5.81 prefill, 40 x 0.1205 = 4.82 decode instances busy
    assert (d.prefill_instances, d.decode_instances) == (6, 5)
    assert d.ratio == pytest.approx(d.decode_s / d.prefill_s) and 0.82 < d.ratio < 0.84
    # KV: 2000 tokens x 320 KiB = 625 MiB over 50 GB/s = 13.1 ms (+ 10 us)
    assert d.kv_bytes == 2000 * kv == 625 * 2**20
    assert d.transfer_s == pytest.approx(10e-6 + 2000 * kv / 50e9)
    assert d.batch_fits and d.max_batch == p.kv_tokens // 2200
    assert d.ttft_s == pytest.approx(d.prefill_s + d.transfer_s + step)

    tp2 = plan.disaggregation(shape, plan.plan(shape, plan.HARDWARE["h200"], dtype="fp8", kv_dtype="bfloat16", tp=2),
                              plan.INTERCONNECTS["ib-ndr400"], 2000, 200, batch=32)
    assert tp2.prefill_s == pytest.approx(d.prefill_s / 2) and tp2.kv_bytes == d.kv_bytes  # each device sends half
    assert tp2.transfer_s == pytest.approx(10e-6 + 1000 * kv / 50e9) and tp2.prefill_instances is None

    args = ["plan", "--model", str(LLAMA3_70B), "--hardware", "h200", "--dtype", "fp8", "--disaggregate",
            "--input-len", "2000", "--output-len", "200", "--batch-size", "32", "--request-rate", "40",
            "--interconnect", "ib-ndr400"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "prefill pool    145.3 ms per request (287.46 TFLOP)" in out
    assert "decode pool     19.29 ms per token at batch 32, context 2,100" in out
    assert "pools           6 prefill : 5 decode at 40 req/s" in out
    assert "KV transfer     625.0 MiB per request, 13.12 ms over ib-ndr400" in out
    assert main([*args, "--json"]) == 0
    part = json.loads(capsys.readouterr().out)["disaggregation"]
    assert (part["prefill_instances"], part["decode_instances"], part["kv_bytes"]) == (6, 5, 625 * 2**20)
    assert main(["plan", "--model", str(LLAMA3_70B), "--input-len", "2000"]) == 2
    assert "add --disaggregate" in capsys.readouterr().err


# -- offline benchmarks ------------------------------------------------------------------------------
def test_bench_throughput_with_hf_baseline(llama_dir, tmp_path, capsys):
    out_json = tmp_path / "tput.json"
    rc = main(["bench", "throughput", "--model", llama_dir, "--num-kv-blocks", "256", "--num-prompts", "6",
               "--output-len", "5", "--repeats", "2", "--threads", "1", "--baseline", "hf",
               "--hf-batch-size", "4", "--output-json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "modserve / hf" in out and "1 torch threads" in out
    assert "greedy agreement with hf (batch 4): 100.0%" in out  # float32, same tokens both ways
    figures = json.loads(out_json.read_text())
    assert set(figures) == {"modserve", "hf", "compute_ceiling_fraction"}  # the CPU's, measured
    assert len(figures["modserve"]) == len(figures["hf"]) == 2 and 0 < figures["compute_ceiling_fraction"] < 1
    assert all(run["output tok/s"] > 0 and run["req/s"] > 0 for name in ("modserve", "hf") for run in figures[name])


def test_hf_baseline_runs_in_its_own_process(llama_dir, tmp_path):
    """The worker gives the tokens transformers gives in this process, and its errors name it."""
    import torch

    from modserve.bench.hf_baseline import HFRunner, StaticBatches

    requests = [BenchRequest(None, [5, 6, 7, 8], 4), BenchRequest(None, [9, 10], 3)]
    with HFRunner(llama_dir, torch.float32, batch_size=2) as runner:
        assert runner.proc.pid != os.getpid() and runner.proc.poll() is None
        run = runner.run(requests)
    assert runner.proc.returncode == 0
    assert run.token_ids == StaticBatches(llama_dir, torch.float32, batch_size=2).run(requests).token_ids
    assert run.output_tokens == 7 and run.prompt_tokens == 6 and run.wall > 0
    with pytest.raises(RuntimeError, match="the transformers worker failed") as err:
        HFRunner(str(tmp_path / "no-model"), torch.float32)
    assert "no-model" in str(err.value)


def test_bench_latency(llama_dir, capsys):
    rc = main(["bench", "latency", "--model", llama_dir, "--num-kv-blocks", "128", "--input-len", "16",
               "--output-len", "4", "--repeats", "2", "--hardware", "h100", "--threads", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TTFT ms" in out and "TPOT ms" in out and "of the h100 single-stream ceiling" in out


# -- compare ------------------------------------------------------------------------------------------
def swapped_kv_heads_attention():
    """A deliberately wrong backend: the reference with its KV heads swapped (a GQA mapping bug)."""
    from modserve.attention_backends.reference import ReferenceAttention

    class Swapped(ReferenceAttention):
        def forward(self, q, k, v, kv_cache, meta, state):
            return super().forward(q, k.flip(1), v.flip(1), kv_cache, meta, state)

    return Swapped


def _compare(tmp_path, llama_dir, a: str, b: str) -> tuple[int, str]:
    paths = []
    for name, backend in (("a", a), ("b", b)):
        path = tmp_path / f"{name}-{backend}.yaml"
        path.write_text(f"attention_backend: {backend}\ndtype: float32\nnum_kv_blocks: 256\nmax_model_len: 1280\n")
        paths.append(str(path))
    rc = main(["compare", *paths, "--model", llama_dir, "--num-prompts", "4", "--output-len", "8",
               "--repeats", "1", "--probe-prompts", "2", "--max-logit-diff", "1e-3", "--threads", "1",
               "--out-dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    return rc, (tmp_path / "out" / "compare.md").read_text()


def test_compare_passes_reference_vs_paged(tmp_path, llama_dir):
    rc, report = _compare(tmp_path, llama_dir, "reference", "paged")
    assert rc == 0, report
    assert "greedy exact match: 4/4 requests (100.0%)" in report and "verdict: pass" in report


def test_compare_finds_a_planted_difference(tmp_path, llama_dir):
    plugin = types.SimpleNamespace(register_attention_backends=hookimpl(
        lambda register: register("swapped-kv", swapped_kv_heads_attention)))
    get_registry().add_plugin(plugin, "test-swapped-kv")  # the fresh_registry fixture forgets it
    rc, report = _compare(tmp_path, llama_dir, "reference", "swapped-kv")
    assert rc == 1
    assert "verdict: FAIL" in report and "max logit difference" in report


def test_compare_refuses_two_multi_rank_engines_before_starting_either(tmp_path, llama_dir, capsys):
    paths = [tmp_path / "a.yaml", tmp_path / "b.yaml"]
    for path in paths:
        path.write_text("tensor_parallel_size: 2\nnum_threads: 1\n")
    assert main(["compare", *map(str, paths), "--model", llama_dir, "--num-prompts", "1"]) == 2
    assert "both run several ranks" in capsys.readouterr().err
    assert multiprocessing.active_children() == []


# -- serve -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _fake_server(delay: float = 0.002):
    """A minimal OpenAI-style SSE server: one chunk per token, ``delay`` s apart; 'fail' prompts get a 500."""
    app = FastAPI()
    state = {"in_flight": 0, "max_in_flight": 0, "bodies": [], "times": [], "headers": []}

    @app.get("/v1/models")
    async def models(request: Request):
        state["headers"].append(dict(request.headers))
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        state["headers"].append(dict(request.headers))
        body = await request.json()
        state["bodies"].append(body)
        state["times"].append(time.monotonic())
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def stream():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                for _ in range(body["max_tokens"]):
                    await asyncio.sleep(delay)
                    yield f'data: {json.dumps({"choices": [{"index": 0, "text": "x"}]})}\n\n'
                usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
                yield f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}", state
    finally:
        server.should_exit = True
        thread.join(5)


@pytest.fixture
def fake_server():
    with _fake_server() as served:
        yield served


def test_bench_serve_against_a_baseline_server_interleaves_and_plots(llama_dir, tmp_path, capsys):
    with _fake_server(0.002) as (fast_url, fast), _fake_server(0.02) as (slow_url, slow):
        result_json, plot = tmp_path / "serve.json", tmp_path / "serve.png"
        rc = main(["bench", "serve", "--base-url", fast_url, "--baseline-url", slow_url, "--names", "fast", "slow",
                   "--workload", "random", "--tokenizer", llama_dir, "--num-prompts", "4", "--input-len", "8",
                   "--output-len", "5", "--request-rate", "50", "--repeats", "2", "--warmups", "0",
                   "--result-json", str(result_json), "--plot", str(plot)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fast / slow" in out and "completed 16, failed 0" in out
    itl_row = next(line for line in out.splitlines() if line.startswith("| ITL median ms"))
    ratio = float(itl_row.rstrip(" |").rsplit("|", 1)[1].split()[0].rstrip("x"))
    assert ratio < 0.5  # 2 ms against 20 ms a token (a busy client only stretches the short gaps)
    # interleaved: fast run 1, slow run 1, fast run 2, slow run 2
    assert max(fast["times"][:4]) < min(slow["times"][:4]) and max(slow["times"][:4]) < min(fast["times"][4:])
    assert min(fast["times"][4:]) < min(slow["times"][4:])
    saved = json.loads(result_json.read_text())
    assert [len(saved[name]["runs"]) for name in ("fast", "slow")] == [2, 2]
    assert plot.stat().st_size > 10_000


def test_serve_client_against_fake_server(fake_server):
    url, state = fake_server
    reqs = [BenchRequest(f"prompt {i}", None, 3 + i % 4) for i in range(12)] + [BenchRequest("fail", None, 3)]
    settings = serve_client.ServeSettings(url, request_rate=200.0, burstiness=0.5, max_concurrency=3,
                                          num_warmups=2, slos=metrics.parse_slos(["ttft:5000"]), progress=False)
    result = serve_client.run(settings, reqs)
    assert result["model"] == "fake-model"
    assert (result["completed"], result["failed"]) == (12, 1)
    assert result["total_output_tokens"] == sum(r.output_len for r in reqs[:12])
    assert result["total_input_tokens"] == 7 * 12  # from the server's usage
    assert "HTTP 500" in result["requests"][12]["error"]
    assert state["max_in_flight"] <= 3
    assert len(state["bodies"]) == 2 + 13  # warm-ups, then every request once
    assert state["bodies"][-1]["ignore_eos"] is True and state["bodies"][-1]["stream"] is True
    assert result["goodput"] == pytest.approx(12 / result["duration_s"])
    itls = [x for r in result["requests"][:12] for x in r["itl"]]
    assert len(itls) == result["total_output_tokens"] - 12  # one gap per token after the first
    for r in result["requests"][:12]:  # the server waits 2 ms before each token
        # from the request's send, not its first token: a late-read first chunk (a busy
        # client) shortens the gap after it, but nothing arrives before the server sent it
        assert r["e2el"] >= r["output_len"] * 0.002 * 0.9 and r["ttft"] >= 0.002 * 0.9
    assert result["tpot_ms"]["mean"] > 0 and result["e2el_ms"]["p99"] >= result["ttft_ms"]["p99"]


def test_bench_serve_against_live_modserve(llama_dir, tmp_path, capsys, monkeypatch):
    """A server that wants an API key takes the bench's requests with $OPENAI_API_KEY (as
    vLLM's bench sends it); one run by default; vLLM's keys agree with modserve's figures."""
    server = launch(tmp_path, "bench-serve", "--model", llama_dir, "--num-kv-blocks", "256", "--dtype", "float32",
                    "--num-threads", "1", env={"MODSERVE_API_KEY": "sk-bench"})
    bench = ["bench", "serve", "--base-url", server.url, "--tokenizer", llama_dir, "--workload", "random",
             "--input-len", "24", "--output-len", "6"]
    try:
        wait_healthy(server, timeout=60)
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        assert main([*bench, "--num-prompts", "1"]) == 2
        assert "401" in capsys.readouterr().err
        monkeypatch.setenv("OPENAI_API_KEY", "sk-bench")
        result_json = tmp_path / "serve.json"
        rc = main([*bench, "--num-prompts", "6", "--request-rate", "20", "--max-concurrency", "4",
                   "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(result_json)])
    finally:
        stop(server)
    assert rc == 0
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "completed 6, failed 0" in out and "over 1 runs" in out
    saved = json.loads(result_json.read_text())
    [run] = saved["runs"]
    assert run["total_output_tokens"] == 36 and run["total_input_tokens"] == 6 * 24  # token-id prompts
    assert run["goodput"] == pytest.approx(run["request_throughput"])
    # vLLM's flat keys, beside modserve's own figures
    assert (saved["completed"], saved["failed"], saved["total_output_tokens"], saved["total_input_tokens"]) == \
        (6, 0, 36, 144)
    assert saved["duration"] == run["duration_s"] and saved["request_goodput"] == run["goodput"]
    assert saved["output_throughput"] == pytest.approx(36 / saved["duration"])
    assert saved["total_token_throughput"] == pytest.approx(180 / saved["duration"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert saved[f"mean_{name}_ms"] == pytest.approx(run[f"{name}_ms"]["mean"])
        assert saved[f"median_{name}_ms"] == pytest.approx(run[f"{name}_ms"]["median"])
    assert saved["std_ttft_ms"] == pytest.approx(np.std([r["ttft"] * 1e3 for r in run["requests"]]))
    assert [saved[f"p99_{name}_ms"] for name in ("ttft", "tpot", "itl")] == \
        pytest.approx([run[f"{name}_ms"]["p99"] for name in ("ttft", "tpot", "itl")])
    assert "p99_e2el_ms" not in saved  # vLLM's default --percentile-metrics: ttft,tpot,itl


# -- vLLM's bench flags ------------------------------------------------------------------------------------
def test_vllm_bench_flags_parse(capsys):
    from modserve.bench.cli import serve_repeats
    from modserve.cli import build_parser

    parser = build_parser()
    a = parser.parse_args(["bench", "serve"])
    assert (a.header, a.percentile_metrics, a.metric_percentiles, serve_repeats(a)) == \
        ([], ["ttft", "tpot", "itl"], [99.0], 1)  # vLLM's defaults: one run
    a = parser.parse_args(["bench", "serve", "--baseline-url", "http://b", "--header", "a=1", "b=2", "--header", "c=3",
                           "--percentile-metrics", "e2el,itl", "--metric-percentiles", "50,99.9"])
    assert (a.header, a.percentile_metrics, a.metric_percentiles, serve_repeats(a)) == \
        (["a=1", "b=2", "c=3"], ["e2el", "itl"], [50.0, 99.9], 3)  # an A/B: 3 interleaved pairs
    assert serve_repeats(parser.parse_args(["bench", "serve", "--num-iters", "2"])) == 2
    for flag, value in (("--percentile-metrics", "ttft,speed"), ("--metric-percentiles", "101"),
                        ("--metric-percentiles", "p99")):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "serve", flag, value])
        assert "a comma list" in capsys.readouterr().err
    assert parser.parse_args(["bench", "latency", "--batch-size", "8"]).batch_size == 8
    assert parser.parse_args(["bench", "throughput", "--n", "4"]).n == 4

    assert serve_client.request_headers([], "sk-env") == {"Authorization": "Bearer sk-env"}
    assert serve_client.request_headers([], None) == {}
    assert serve_client.request_headers(["X-A = 1", "authorization=Bearer other"], "sk-env") == \
        {"X-A": "1", "authorization": "Bearer other"}  # a header of the same name replaces the key's
    with pytest.raises(ValueError, match="KEY=VALUE"):
        serve_client.request_headers(["X-A"], None)


def test_vllm_latency_keys_by_hand():
    assert (metrics.percentile_word(99.0), metrics.percentile_word(99.9)) == ("99", "99.9")
    keys = metrics.latency_keys({"ttft": [0.010, 0.020, 0.030, 0.100], "tpot": [], "itl": [0.001]},
                                ["ttft", "tpot"], [50, 99.9])
    assert keys == pytest.approx({
        "mean_ttft_ms": 40.0, "median_ttft_ms": 25.0, "std_ttft_ms": math.sqrt(1250), "p50_ttft_ms": 25.0,
        "p99.9_ttft_ms": 30 + 0.997 * 70,  # between the 3rd and 4th of 4
        **{f"{stat}_tpot_ms": 0.0 for stat in ("mean", "median", "std", "p50", "p99.9")},  # none: 0, as vLLM
        "mean_itl_ms": 1.0, "median_itl_ms": 1.0, "std_itl_ms": 0.0})  # not chosen: no percentiles
    runs = [{"duration": d, "completed": 4, "request_goodput": None, "mean_ttft_ms": m, "ttft_ms": {"mean": m},
             "slos_ms": {}, "model": "x"} for d, m in ((1.0, 10.0), (3.0, 30.0), (2.0, 50.0))]
    assert serve_client.vllm_result(runs) == {"duration": 2.0, "completed": 4.0, "request_goodput": None,
                                              "mean_ttft_ms": 30.0}  # medians over the runs
    assert serve_client.vllm_result(runs[:1]) == {"duration": 1.0, "completed": 4, "request_goodput": None,
                                                  "mean_ttft_ms": 10.0}


def test_bench_serve_sends_headers_and_saves_chosen_percentiles(fake_server, tmp_path, capsys, monkeypatch):
    url, state = fake_server
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    path = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--output-len", "3", "--warmups", "0",
               "--header", "X-Trace=abc", "--header", "x-tenant=t1", "x-more = 2",
               "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9", "--result-json", str(path)])
    assert rc == 0
    assert len(state["headers"]) == 1 + 4  # /v1/models, then every request
    assert all((h["authorization"], h["x-trace"], h["x-tenant"], h["x-more"]) == ("Bearer sk-test", "abc", "t1", "2")
               for h in state["headers"])
    out = capsys.readouterr().out
    assert "| TTFT p99.9 ms" in out and "| E2EL p50 ms" in out and "| TPOT" not in out and "| ITL" not in out
    saved = json.loads(path.read_text())
    [run] = saved["runs"]
    e2el = [r["e2el"] * 1e3 for r in run["requests"]]
    assert saved["p50_e2el_ms"] == pytest.approx(saved["median_e2el_ms"]) and saved["median_e2el_ms"] > 0
    assert saved["p99.9_e2el_ms"] == pytest.approx(np.percentile(e2el, 99.9))
    assert saved["p50_ttft_ms"] == pytest.approx(run["ttft_ms"]["median"])
    assert "mean_tpot_ms" in saved and not any(k.startswith("p") and k.endswith(("_tpot_ms", "_itl_ms")) for k in saved)


def test_bench_latency_batch_size_saves_vllms_keys(llama_dir, tmp_path, capsys, monkeypatch):
    from modserve.bench import offline

    assert main(["bench", "latency", "--model", llama_dir, "--batch-size", "2", "--baseline", "vllm"]) == 2
    assert "times modserve only" in capsys.readouterr().err
    sizes, real_run = [], offline.EngineRunner.run
    monkeypatch.setattr(offline.EngineRunner, "run", lambda self, reqs: sizes.append(len(reqs)) or real_run(self, reqs))
    path = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", llama_dir, "--num-kv-blocks", "128", "--input-len", "8",
               "--output-len", "3", "--batch-size", "3", "--repeats", "2", "--threads", "1", "--output-json", str(path)])
    assert rc == 0
    assert sizes == [3, 3, 3]  # the warm-up, then two timed batches of 3
    assert "a batch of 3" in capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert saved["latencies"] == pytest.approx([r["E2E ms"] / 1e3 for r in saved["runs"]])
    assert saved["avg_latency"] == pytest.approx(np.mean(saved["latencies"]))
    assert saved["std_latency"] == pytest.approx(np.std(saved["latencies"]))
    assert list(saved["percentiles"]) == ["10", "25", "50", "75", "90", "99"]


def test_bench_throughput_n_sequences_per_prompt(llama_dir, tmp_path, capsys):
    assert main(["bench", "throughput", "--model", llama_dir, "--n", "2", "--baseline", "hf"]) == 2
    assert "runs modserve only" in capsys.readouterr().err
    path = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", llama_dir, "--num-kv-blocks", "256", "--num-prompts", "3",
               "--output-len", "4", "--n", "2", "--repeats", "1", "--threads", "1", "--hardware", "h100",
               "--output-json", str(path)])
    assert rc == 0
    [run] = json.loads(path.read_text())["modserve"]
    assert run["output tok/s"] * run["wall s"] == pytest.approx(3 * 2 * 4)  # every sample's tokens
    assert run["req/s"] * run["wall s"] == pytest.approx(3)


def test_bench_names_the_quantization_it_measured(llama_dir, capsys):
    rc = main(["bench", "throughput", "--model", llama_dir, "--num-kv-blocks", "256", "--num-prompts", "1",
               "--output-len", "2", "--repeats", "1", "--warmups", "0", "--threads", "1",
               "--quantization", '{"name": "int8", "options": {"activations": "float32"}}'])
    assert rc == 0
    model_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("model: "))
    assert 'quantization int8 {"activations": "float32"}' in model_line
