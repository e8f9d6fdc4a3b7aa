"""The compute-ceiling fraction `bench throughput` and `bench latency` print: FLOPs counted by hand."""

from __future__ import annotations

import json

import pytest
import torch

from modserve.bench.plan import HARDWARE, ModelShape
from modserve.bench.roofline import attention_flops, compute_fraction, linear_flops_per_token, request_flops
from modserve.cli import main

# Llama-2-7B's shape: 32 layers, hidden 4096, 32 heads of 128, MLP 11008, vocabulary 32000.
LLAMA2_7B = ModelShape.from_config({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000})


def test_flops_of_a_llama2_7b_token_by_hand():
    attn = 4 * 4096 * 4096  # q, k, v, o
    mlp = 3 * 4096 * 11008  # gate, up, down
    # 2 FLOPs per weight of the layers and the LM head; the embedding lookup multiplies nothing
    assert linear_flops_per_token(LLAMA2_7B) == 2 * (32 * (attn + mlp + 2 * 4096) + 32000 * 4096)
    assert round(linear_flops_per_token(LLAMA2_7B) / 1e9, 1) == 13.2  # "2 x 6.6 B non-embedding parameters"
    # position p attends to p + 1 positions: 4 x layers x 4096 FLOPs for each
    assert attention_flops(LLAMA2_7B, 0, 1) == 4 * 32 * 4096
    assert attention_flops(LLAMA2_7B, 0, 3) == 4 * 32 * 4096 * (1 + 2 + 3)
    assert attention_flops(LLAMA2_7B, 0, 5) == attention_flops(LLAMA2_7B, 0, 2) + attention_flops(LLAMA2_7B, 2, 5)
    # a prompt of 10 and 4 output tokens: 13 tokens go through the model (the last is only sampled)
    assert request_flops(LLAMA2_7B, 10, 4) == 13 * linear_flops_per_token(LLAMA2_7B) + attention_flops(LLAMA2_7B, 0, 13)
    assert request_flops(LLAMA2_7B, 10, 1) == request_flops(LLAMA2_7B, 10, 0)  # the prompt alone


def test_the_fraction_is_flops_over_time_over_peak():
    f = compute_fraction(LLAMA2_7B, HARDWARE["h100"], "bfloat16", [(1000, 1)] * 8, seconds=0.5)
    assert f.flops == 8 * request_flops(LLAMA2_7B, 1000, 1)
    assert f.fraction == pytest.approx(f.flops / 0.5 / 989e12)
    assert "of the h100 compute ceiling of 989.000 TFLOP/s" in f.line("h100", "run")


def test_bench_throughput_reports_its_fraction_of_the_compute_ceiling(llama_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", llama_dir, "--dtype", "float32", "--workload", "random",
                 "--input-len", "16", "--output-len", "4", "--num-prompts", "4", "--repeats", "1", "--warmups", "0",
                 "--hardware", "h100", "--output-json", str(out)]) == 0
    figures = json.loads(out.read_text())
    shape = ModelShape.load(llama_dir)
    expected = 4 * request_flops(shape, 16, 4) / figures["modserve"][0]["wall s"] / HARDWARE["h100"].flops_32
    assert figures["compute_ceiling_fraction"] == pytest.approx(expected)
    assert "of the h100 compute ceiling of 67.000 TFLOP/s" in capsys.readouterr().out


def test_the_cpu_bandwidth_is_a_read_beyond_the_last_level_cache(tmp_path, monkeypatch):
    """``measure_cpu``'s bandwidth, the decode ceiling ``bench latency`` divides by, reads twice
    the largest cache (sysfs sizes in K, M or G), at least READ_MIN_BYTES: a sum of a buffer
    the cache holds would time the cache."""
    from modserve.bench import plan

    for index, (level, size) in enumerate([(1, "48K"), (1, "64K"), (2, "2048K"), (3, "491520K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert plan.last_level_cache_bytes(tmp_path) == 480 << 20
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "level").write_text("4\n")
    (tmp_path / "index4" / "size").write_text("1G\n")
    assert plan.last_level_cache_bytes(tmp_path) == 1 << 30
    (tmp_path / "index5").mkdir()
    (tmp_path / "index5" / "level").write_text("5\n")
    (tmp_path / "index5" / "size").write_text("\n")  # unreadable: skipped
    assert plan.last_level_cache_bytes(tmp_path) == 1 << 30
    assert plan.last_level_cache_bytes(tmp_path / "absent") == 0

    monkeypatch.setattr(plan, "READ_MIN_BYTES", 4 << 20)
    monkeypatch.setattr(plan, "last_level_cache_bytes", lambda: 3 << 20)
    buffer = plan.read_buffer()
    assert buffer.nbytes == 6 << 20 and bool((buffer == 1).all())
    monkeypatch.setattr(plan, "last_level_cache_bytes", lambda: 1 << 20)
    assert plan.read_buffer().nbytes == 4 << 20
    read = []
    monkeypatch.setattr(plan, "read_buffer", lambda: read.append(1) or torch.ones(1 << 20))
    assert plan.measure_cpu(seconds=0.01).bandwidth > 0 and read == [1]
