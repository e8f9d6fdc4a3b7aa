"""A server started as a vLLM user starts one behaves as vLLM's would, or says where it does
not: VLLM_API_KEY protects it, --disable-uvicorn-access-log turns the access log off, the
local path never shows as the model's name, and the loopback-only default is said loudly."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import openai
import pytest

from modserve import vllm_compat
from modserve.core.config import EngineConfig
from modserve.runner.ranks import rank_layout
from modserve.server.cli import env_api_key
from modserve.server.model_names import default_served_name
from server_process import Server, launch, stop, wait_healthy

KEY = "vllm-sekret"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    # vLLM's spellings only: no --host, no --served-model-name, the key in vLLM's variable.
    server = launch(tmp_path_factory.mktemp("parity"), "vllm-style", "--model", llama_dir, "--num-threads", "1",
                    "--num-gpu-blocks-override", "32", "--max-model-len", "128", "--disable-uvicorn-access-log",
                    env={"VLLM_API_KEY": KEY, "MODSERVE_API_KEY": ""})
    try:
        wait_healthy(server, timeout=60)
        yield server
    finally:
        stop(server)


def get_models(server: Server, key: str | None) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})


def test_vllm_api_key_protects_the_server(server):
    assert get_models(server, None).status_code == 401
    assert get_models(server, "wrong").status_code == 401
    assert get_models(server, KEY).status_code == 200
    assert KEY not in server.log.read_text()


def test_the_local_path_is_never_the_models_name_but_still_matches(server, llama_dir):
    r = get_models(server, KEY)
    assert [m["id"] for m in r.json()["data"]] == [Path(llama_dir).name] and llama_dir not in r.text
    # a vLLM-style client sends the --model string as the model
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": llama_dir, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == Path(llama_dir).name, r.text


def test_no_access_log_and_a_loud_loopback_warning(server):
    get_models(server, KEY)
    log = server.log.read_text()
    assert "GET /v1/models" not in log and "GET /health" not in log
    assert any("WARNING" in line and "--host 0.0.0.0" in line for line in log.splitlines())


# -- without a server --------------------------------------------------------------------------------
def test_modserve_api_key_wins_over_vllm_api_key(monkeypatch, caplog):
    monkeypatch.setenv("MODSERVE_API_KEY", "ours")
    monkeypatch.setenv("VLLM_API_KEY", "theirs")
    with caplog.at_level(logging.WARNING, logger="modserve"):
        assert env_api_key() == "ours"
    assert "using MODSERVE_API_KEY" in caplog.text and "ours" not in caplog.text.replace("MODSERVE", "")
    monkeypatch.delenv("MODSERVE_API_KEY")
    assert env_api_key() == "theirs"


def test_an_ignored_option_at_vllms_default_says_nothing(llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="modserve"):
        vllm_compat.engine_config({"model": llama_dir}, uvicorn_log_level="info", disable_log_requests=True,
                                  disable_uvicorn_access_log=True, max_seq_len_to_capture=8192)
    assert "ignoring" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="modserve"):
        vllm_compat.engine_config({"model": llama_dir}, uvicorn_log_level="debug")
    assert "ignoring vLLM option uvicorn_log_level" in caplog.text


def test_pipeline_stages_are_not_called_tensor_ranks(llama_dir):
    layout = rank_layout(EngineConfig(model=llama_dir, pipeline_parallel_size=2))
    assert layout == "2 ranks: 2 pipeline stage(s) x 1 tensor-parallel rank(s)"


def test_a_hugging_face_snapshot_is_named_by_its_repository():
    path = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abc"
    assert default_served_name(path) == "Qwen/Qwen2.5-0.5B"
    assert default_served_name("/models/qwen2.5-0.5b/") == "qwen2.5-0.5b"


def test_a_vllm_config_files_access_log_key_reaches_the_server(llama_dir, tmp_path):
    from modserve import cli

    path = tmp_path / "vllm.yaml"
    path.write_text(f"model: {llama_dir}\ndisable-uvicorn-access-log: true\n")
    args = cli.build_parser().parse_args(["serve", "--config", str(path)])
    cli.config_from_args(args)
    assert args.vllm_disable_uvicorn_access_log is True


def _completion(server: Server, **kwargs) -> openai.types.Completion:
    client = server.client(KEY)
    return client.completions.create(model=client.models.list().data[0].id, prompt="The old castle",
                                     temperature=0, **kwargs)


def test_min_tokens_holds_back_stop_strings(server):
    """As vLLM: no stop string ends the first min_tokens tokens; the text after them is searched."""
    first3 = _completion(server, max_tokens=3).choices[0].text
    stop = next(c for c in first3 if not c.isspace())  # a character the first tokens hold
    stopped = _completion(server, max_tokens=12, stop=[stop]).choices[0]
    assert stop not in stopped.text and stopped.finish_reason == "stop"
    held = _completion(server, max_tokens=12, stop=[stop], extra_body={"min_tokens": 3}).choices[0]
    assert held.text.startswith(first3) and len(held.text) > len(stopped.text)
    assert stop not in held.text[len(first3):]  # cut at the first stop after the third token


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_refused_as_vllm_does(server, field):
    client = server.client(KEY)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], **{field: 200})
    assert refused.value.body["param"] == field
    assert "is too large: 200. This model's maximum context length is 128 tokens" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        _completion(server, max_tokens=126)  # 126 + the prompt's tokens > 128
    assert refused.value.body["param"] == "max_tokens"
    assert _completion(server, max_tokens=8).choices[0].finish_reason == "length"  # within the context: served


def _stream_chunks(server: Server, path: str, body: dict) -> list[dict]:
    """Every data chunk of a streamed response, [DONE] left out."""
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True}, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "The old castle"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, path, body):
    body = {**body, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    chunks = _stream_chunks(server, path, {**body, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages) and chunks[-1]["choices"] == []
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # include_usage alone: only the last chunk has it
    plain = _stream_chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert [c.get("usage") is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_spaces_between_special_tokens_request_field(server):
    ok = _completion(server, max_tokens=2, extra_body={"spaces_between_special_tokens": False})
    assert ok.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        _completion(server, max_tokens=2, extra_body={"spaces_between_special_tokens": False,
                                                      "skip_special_tokens": False})
    assert refused.value.body["param"] == "spaces_between_special_tokens"


@pytest.mark.parametrize("text, value", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 2**20),
                                         ("2g", 2 * 10**9), ("4096", 4096), (4096, 4096)])
def test_human_readable_ints_follow_vllms_rule(text, value):
    assert vllm_compat.human_readable_int(text) == value


def test_max_model_len_with_a_suffix_and_max_logprobs_on_the_command_line(llama_dir):
    from modserve import cli

    with pytest.raises(ValueError, match="a fraction takes a decimal suffix"):
        vllm_compat.human_readable_int("1.5K")
    args = cli.build_parser().parse_args(["serve", llama_dir, "--max-model-len", "1k", "--max-logprobs", "7",
                                          "--max-num-batched-tokens", "1K"])
    config = cli.config_from_args(args)
    assert (config.max_model_len, config.max_logprobs, config.max_num_batched_tokens) == (1000, 7, 1024)
