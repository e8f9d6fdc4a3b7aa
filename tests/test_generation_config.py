"""The checkpoint's generation_config.json sets the sampling defaults, as in vLLM: requests
that leave a field unset take the file's value, offline and at the server; a request's own
value wins; --generation-config vllm ignores the file; --override-generation-config is
merged over it.

The checkpoint here asks for top_k 1 (greedy) and 8 new tokens: three identical unseeded
requests must then give one text, the greedy one."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from modserve import LLM, SamplingParams
from modserve.core.config import EngineConfig
from server_process import Server, launch, stop, wait_healthy

PROMPT = "The old castle"
CHECKPOINT_DEFAULTS = {"top_k": 1, "temperature": 0.01, "max_new_tokens": 8, "do_sample": False}
NEW_TOKENS = CHECKPOINT_DEFAULTS["max_new_tokens"]
MESSAGES = [{"role": "user", "content": "Tell me of the old castle."}]
RUNS = dict(extra_body={"ignore_eos": True})  # a random model's early EOS would hide what was sampled


def _write_generation_config(directory, values: dict) -> None:
    path = directory / "generation_config.json"
    found = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**found, **values}))


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny checkpoint with sampling defaults in its generation_config.json."""
    model = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(llama_dir, model)
    _write_generation_config(model, CHECKPOINT_DEFAULTS)
    return str(model)


def _defaults(model: str, **fields):
    from modserve.generation_defaults import GenerationDefaults

    return GenerationDefaults.of(EngineConfig(model=model, **fields))


# -- offline ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, dtype="float32", num_kv_blocks=16, max_model_len=128, progress=False) as llm:
        yield llm


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_offline_requests_without_sampling_params_take_the_checkpoints_defaults(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    unseeded = [llm.generate(PROMPT, use_tqdm=False)[0] for _ in range(3)]
    assert _token_ids(unseeded) == _token_ids(greedy) * 3
    chat = [llm.chat(MESSAGES, use_tqdm=False)[0].outputs[0].text for _ in range(3)]
    assert len(set(chat)) == 1
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.01, NEW_TOKENS)


def test_offline_sampling_params_passed_keep_their_own_fields(llm):
    """As vLLM's LLM.generate: a SamplingParams given is used as it is (temperature 1, no top-k)."""
    outputs = llm.generate([PROMPT] * 3, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert len(set(map(tuple, _token_ids(outputs)))) > 1


# -- what is read -------------------------------------------------------------------------------


def test_the_six_fields_are_read_and_do_sample_is_not(tmp_path, caplog):
    _write_generation_config(tmp_path, {"do_sample": False, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                        "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 32,
                                        "num_beams": 1, "eos_token_id": 2, "typical_p": None})
    with caplog.at_level(logging.WARNING, logger="modserve"):
        defaults = _defaults(str(tmp_path))
    assert defaults.values == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                               "repetition_penalty": 1.1, "max_tokens": 32}
    assert defaults.max_tokens_cap is None and defaults.max_tokens(None) == 32 and defaults.max_tokens(100) == 100
    assert f"default sampling parameters from {tmp_path / 'generation_config.json'}: temperature=0.6" in caplog.text
    assert _defaults(str(tmp_path), generation_config="vllm").sampling_params() == SamplingParams()


def test_override_is_merged_over_the_file_with_vllm_too(model_dir, caplog):
    override = {"temperature": 0, "max_new_tokens": 4, "seed": 3}
    with caplog.at_level(logging.WARNING, logger="modserve"):
        merged = _defaults(model_dir, override_generation_config=override)
    assert merged.values == {"top_k": 1, "temperature": 0, "max_tokens": 4}
    assert "override_generation_config: seed ignored" in caplog.text
    # its max_new_tokens caps what a request asks for, as vLLM's override_max_tokens
    assert (merged.max_tokens(None), merged.max_tokens(16), merged.max_tokens(2)) == (4, 4, 2)
    alone = _defaults(model_dir, generation_config="vllm", override_generation_config={"temperature": 0})
    assert alone.values == {"temperature": 0} and alone.max_tokens_cap is None


def test_a_directory_named_is_read_and_its_max_new_tokens_caps(model_dir, tmp_path):
    _write_generation_config(tmp_path, {"temperature": 0, "max_new_tokens": 4})
    defaults = _defaults(model_dir, generation_config=str(tmp_path))
    assert defaults.values == {"temperature": 0, "max_tokens": 4} and defaults.max_tokens(16) == 4
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        _defaults(model_dir, generation_config=str(tmp_path))


def test_an_invalid_default_fails_at_start_naming_the_file(tmp_path):
    _write_generation_config(tmp_path, {"top_p": 0})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        _defaults(str(tmp_path))
    with pytest.raises(ValueError, match="override_generation_config: temperature must be >= 0"):
        _defaults(str(tmp_path), generation_config="vllm", override_generation_config={"temperature": -1})


def test_the_flags_reach_the_config(llama_dir):
    from modserve import cli

    args = cli.build_parser().parse_args(["serve", llama_dir, "--generation-config", "vllm",
                                          "--override-generation-config", '{"temperature": 0}'])
    config = cli.config_from_args(args)
    assert (config.generation_config, config.override_generation_config) == ("vllm", {"temperature": 0})
    field = EngineConfig.model_fields["override_generation_config"]
    assert cli.field_help("override_generation_config", field)[0] == "JSON"


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launched(model_dir, llama_dir, tmp_path_factory):
    """Three servers, started together (each test waits for its own): the checkpoint's defaults,
    the same checkpoint with --generation-config vllm, and one without defaults given
    --override-generation-config."""
    tmp = tmp_path_factory.mktemp("generation-config-servers")
    common = ["--num-threads", "1", "--num-kv-blocks", "32", "--max-model-len", "128"]
    servers = {"auto": launch(tmp, "auto", model_dir, *common),
               "vllm": launch(tmp, "vllm", model_dir, "--generation-config", "vllm", *common),
               "override": launch(tmp, "override", llama_dir, "--override-generation-config",
                                  '{"temperature": 0}', *common)}
    try:
        yield servers
    finally:
        for server in servers.values():
            stop(server)


def _ready(launched, name: str) -> Server:
    wait_healthy(launched[name], timeout=120)
    return launched[name]


def _completions(server: Server, n: int = 3, **fields) -> list[str]:
    client = server.client()
    model = client.models.list().data[0].id
    fields = {"max_tokens": NEW_TOKENS, **RUNS, **fields}
    return [client.completions.create(model=model, prompt=PROMPT, **fields).choices[0].text for _ in range(n)]


def test_server_requests_leaving_fields_unset_take_the_checkpoints_defaults(launched):
    server = _ready(launched, "auto")
    texts = _completions(server)
    assert texts == _completions(server, n=1, temperature=0) * 3
    client = server.client()
    model = client.models.list().data[0].id
    chats = [client.chat.completions.create(model=model, messages=MESSAGES, **RUNS) for _ in range(3)]
    assert len({c.choices[0].message.content for c in chats}) == 1
    assert [c.usage.completion_tokens for c in chats] == [NEW_TOKENS] * 3  # max_new_tokens, for max_tokens
    assert "default sampling parameters from" in server.log.read_text()


def test_server_a_requests_own_values_win(launched):
    texts = _completions(_ready(launched, "auto"), temperature=1.0, extra_body={"top_k": -1, "ignore_eos": True})
    assert len(set(texts)) > 1


def test_server_generation_config_vllm_ignores_the_file(launched):
    server = _ready(launched, "vllm")
    assert len(set(_completions(server))) > 1
    assert "default sampling parameters" not in server.log.read_text()


def test_server_override_generation_config(launched):
    server = _ready(launched, "override")
    assert len(set(_completions(server))) == 1
    assert len(set(_completions(server, temperature=1.0))) > 1  # the request's own temperature wins
