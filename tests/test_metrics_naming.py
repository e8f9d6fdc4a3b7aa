"""``--metrics-naming vllm``: a real server's /metrics, after a few requests, holds vLLM's
families with vLLM's types, labels and buckets, so a dashboard made for vLLM reads it.

VLLM_FAMILIES is taken from vLLM's source, vllm/v1/metrics/loggers.py
(``PrometheusStatLogger.__init__``): each family's ``name``, class (Gauge, Counter, Histogram),
``labelnames`` (``["model_name", "engine"]``, plus ``finished_reason`` for request_success)
and ``buckets``. vLLM has more families than modserve emits (request_time_per_output_token,
request_params_n, request_max_num_generation_tokens, request_prefill_kv_computed_tokens,
spec decoding, LoRA, cache_config_info, ...); these are the ones docs/server.md lists.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import serving, wait_for

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
LABELS = {"model_name", "engine"}

TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # build_1_2_5_buckets(max_model_len=512)
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# family (as vLLM names it; counters gain _total on the wire) -> (type, labels, histogram buckets)
VLLM_FAMILIES: dict[str, tuple[str, set[str], list[float] | None]] = {
    "vllm:num_requests_running": ("gauge", LABELS, None),
    "vllm:num_requests_waiting": ("gauge", LABELS, None),
    "vllm:kv_cache_usage_perc": ("gauge", LABELS, None),
    "vllm:prefix_cache_queries": ("counter", LABELS, None),
    "vllm:prefix_cache_hits": ("counter", LABELS, None),
    "vllm:num_preemptions": ("counter", LABELS, None),
    "vllm:prompt_tokens": ("counter", LABELS, None),
    "vllm:generation_tokens": ("counter", LABELS, None),
    "vllm:request_success": ("counter", LABELS | {"finished_reason"}, None),
    "vllm:request_prompt_tokens": ("histogram", LABELS, TOKENS),
    "vllm:request_generation_tokens": ("histogram", LABELS, TOKENS),
    "vllm:request_params_max_tokens": ("histogram", LABELS, TOKENS),
    "vllm:iteration_tokens_total": ("histogram", LABELS, ITERATION),
    "vllm:time_to_first_token_seconds": ("histogram", LABELS, TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", LABELS, ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", LABELS, REQUEST_LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", LABELS, REQUEST_LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", LABELS, REQUEST_LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", LABELS, REQUEST_LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", LABELS, REQUEST_LATENCY),
}
FINISH_REASONS = {"stop", "length", "abort", "error"}  # vLLM's FinishReason, each series there from the start


def differences(text: str) -> list[str]:
    """How the exposition ``text`` departs from VLLM_FAMILIES (empty: it matches)."""
    found = {f.name: f for f in text_string_to_metric_families(text)
             if f.name.startswith("vllm:") and not f.name.endswith("_created")}  # _created: the client library's
    out = [f"missing {n}" for n in VLLM_FAMILIES if n not in found]
    out += [f"not vLLM's: {n}" for n in found if n not in VLLM_FAMILIES]
    out += [f"not vllm: named: {f.name}" for f in text_string_to_metric_families(text) if f.name.startswith("modserve")]
    for name, family in found.items():
        if name not in VLLM_FAMILIES:
            continue
        kind, labels, buckets = VLLM_FAMILIES[name]
        if family.type != kind:
            out.append(f"{name} is a {family.type}, vLLM's a {kind}")
        for s in family.samples:
            if set(s.labels) - {"le"} != labels:
                out.append(f"{s.name} labels {sorted(s.labels)}, vLLM's {sorted(labels)}")
            elif s.labels["model_name"] != MODEL or s.labels["engine"] != "0":
                out.append(f"{s.name} labelled {s.labels}")
        if buckets is not None:
            les = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
            if les != [*map(float, buckets), float("inf")]:
                out.append(f"{name} buckets {les}")
        if name == "vllm:request_success":
            reasons = {s.labels["finished_reason"] for s in family.samples if s.name.endswith("_total")}
            if reasons != FINISH_REASONS:
                out.append(f"{name} finished_reason {sorted(reasons)}")
    return out


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("vllm-metrics"), "vllm-metrics", "--model", llama_dir, "--served-model-name",
                 MODEL, "--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN),
                 "--metrics-naming", "vllm") as s:
        yield s


def _values(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in LABELS}
            out[s.name + (str(sorted(extra.items())) if extra else "")] = s.value
    return out


def test_vllm_families_names_types_labels_and_buckets(server):
    prompts = ["In the beginning", "And God said"]
    for prompt in prompts:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                             "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code in (200, 400), r.text  # 400: a checkpoint without a chat template
    text = httpx.get(f"{server.url}/metrics").text
    assert differences(text) == []
    v = _values(text)
    length = v["vllm:request_success_total[('finished_reason', 'length')]"]
    assert length >= 2
    assert v["vllm:e2e_request_latency_seconds_count"] >= 2 and v["vllm:time_to_first_token_seconds_count"] >= 2
    assert v["vllm:request_decode_time_seconds_count"] >= 2
    assert v["vllm:request_generation_tokens_sum"] >= 16 and v["vllm:request_params_max_tokens_sum"] >= 16

    def engine_counted() -> bool:  # the engine's counters are read between its steps: they may lag
        v = _values(httpx.get(f"{server.url}/metrics").text)
        return (v["vllm:prompt_tokens_total"] > 0 and v["vllm:generation_tokens_total"] >= 16
                and v["vllm:iteration_tokens_total_count"] > 0 and v["vllm:iteration_tokens_total_sum"] > 0
                and v["vllm:prefix_cache_queries_total"] >= v["vllm:prefix_cache_hits_total"]
                and v["vllm:kv_cache_usage_perc"] == 0 and v["vllm:num_requests_running"] == 0)

    wait_for(engine_counted)


def test_a_planted_fault_is_caught(server):
    """The comparison itself: a renamed family, a dropped label and changed buckets each show."""
    text = httpx.get(f"{server.url}/metrics").text
    renamed = differences(text.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
    assert "missing vllm:kv_cache_usage_perc" in renamed and "not vLLM's: vllm:gpu_cache_usage_perc" in renamed
    unlabelled = differences(text.replace('vllm:num_requests_waiting{engine="0",', "vllm:num_requests_waiting{"))
    assert any(d.startswith("vllm:num_requests_waiting labels") for d in unlabelled)
    rebucketed = differences(text.replace('vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"',
                                          'vllm:request_queue_time_seconds_bucket{engine="0",le="0.25"'))
    assert any(d.startswith("vllm:request_queue_time_seconds buckets") for d in rebucketed)
