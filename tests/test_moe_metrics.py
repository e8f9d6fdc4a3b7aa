"""Per-expert load figures of mixture-of-experts models: counted in each MoE layer as tokens
are routed, read by engine.stats(), exposed in /metrics and printed by `bench throughput`."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modserve import LLM, SamplingParams
from modserve.bench.cli import expert_load_lines
from modserve.cli import main
from modserve.server.metrics import ServerMetrics, imbalance

PROMPTS = [[5 + i, 9, 13 + 2 * i, 7] * (1 + i) for i in range(5)]  # 4 to 20 tokens, no shared prefix
OUTPUT = 6


@pytest.fixture(scope="module")
def mixtral_dir(checkpoint_dir) -> str:
    return checkpoint_dir("mixtral")


def test_every_token_is_counted_once_per_expert_it_picks(mixtral_dir):
    """Each layer's counts sum to top-k x the tokens the forward passes computed: every prompt
    token and every output token but the last (it is sampled, never fed back)."""
    llm = LLM(mixtral_dir, num_kv_blocks=256, progress=False, moe_backend="fused",
              kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}})
    assert llm.engine.runner.expert_load() == {0: [0] * 8, 1: [0] * 8, 2: [0] * 8}  # zeroed after loading
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True), use_tqdm=False)
    load = llm.engine.stats()["expert_tokens"]
    computed = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (OUTPUT - 1)
    assert sorted(load) == [0, 1, 2] and all(sum(c) == 2 * computed for c in load.values())
    assert all(len(c) == 8 for c in load.values())

    text = ServerMetrics().render(llm.engine.stats()).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {(s.labels["layer"], s.labels["expert"]): s.value for s in families["modserve_moe_expert_tokens"].samples
              if s.name.endswith("_total")}
    assert tokens == {(str(layer), str(e)): float(n) for layer, c in load.items() for e, n in enumerate(c)}
    uneven = {s.labels["layer"]: s.value for s in families["modserve_moe_expert_imbalance"].samples}
    assert uneven == {str(layer): pytest.approx(max(c) / (sum(c) / 8)) for layer, c in load.items()}


def test_imbalance_and_the_bench_lines():
    assert imbalance([5, 5, 5, 5]) == 1.0 and imbalance([8, 0, 0, 0]) == 4.0 and imbalance([0, 0]) == 0.0
    lines = expert_load_lines({3: [1, 6, 0, 1]})
    assert lines[1] == "  layer 3: imbalance 3.00, hottest expert 1 (75.0% of routed tokens), idle experts 1 of 4"


def test_a_dense_model_reports_no_expert_load(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=256, progress=False)
    assert llm.engine.runner.expert_load() == {} and "expert_tokens" not in llm.engine.stats()
    assert b"modserve_moe" not in ServerMetrics().render(llm.engine.stats())


def test_bench_throughput_prints_and_saves_the_expert_load(mixtral_dir, tmp_path, capsys):
    out = tmp_path / "tput.json"
    assert main(["bench", "throughput", "--model", mixtral_dir, "--num-kv-blocks", "256", "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "4", "--repeats", "1", "--warmups", "0", "--threads", "1",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "expert load (tokens routed per expert over every run; imbalance = hottest / mean):" in text
    load = json.loads(out.read_text())["expert_load"]
    assert sorted(load) == ["0", "1", "2"]
    for layer in load.values():
        assert len(layer["tokens"]) == 8 and layer["imbalance"] == pytest.approx(imbalance(layer["tokens"]), abs=1e-3)
        assert layer["tokens"][layer["hottest"]] == max(layer["tokens"])


def test_data_parallel_replicas_sum_their_expert_load():
    from modserve.server.replicas import sum_stats

    total = sum_stats([{"expert_tokens": {0: [1, 2], 1: [0, 5]}, "steps": 2}, {"expert_tokens": {0: [3, 4]}, "steps": 1}])
    assert total == {"expert_tokens": {0: [4, 6], 1: [0, 5]}, "steps": 3}
