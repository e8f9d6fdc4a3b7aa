"""A server started as a vLLM user starts one behaves as vLLM's would, or says where it does
not: VLLM_API_KEY protects it, --disable-uvicorn-access-log turns the access log off, the
local path never shows as the model's name, and the loopback-only default is said loudly."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
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
