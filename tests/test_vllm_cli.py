"""A vLLM user at home: vLLM's command lines and config files resolve to the EngineConfig
they mean, what modserve lacks is named, and the CLI's rough edges are gone."""

from __future__ import annotations

import argparse
import json
import logging
import types
from pathlib import Path

import httpx
import pytest

from modserve import cli
from modserve import vllm_compat
from modserve.config_files import config_from_file
from modserve.core.config import EngineConfig
from modserve.core.hookspecs import hookimpl
from modserve.core.registry import get_registry
from server_process import launch, stop, wait_healthy

NGRAM_JSON = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def resolve(argv: list[str]) -> tuple[EngineConfig, argparse.Namespace]:
    """The EngineConfig a command line resolves to, parsed as `modserve` parses it."""
    args = cli.build_parser().parse_args(argv)
    return cli.config_from_args(args), args


# -- command lines and files ---------------------------------------------------------------------
def test_a_vllm_command_line_resolves_to_the_engine_config(llama_dir):
    config, args = resolve([
        "serve", llama_dir, "--served-model-name", "tiny", "tiny-alias", "--enable-prefix-caching",
        "--enable-chunked-prefill", "--long-prefill-token-threshold", "64", "--kv-cache-dtype", "fp8",
        "--speculative-config", NGRAM_JSON, "--enforce-eager", "--swap-space", "2", "-tp", "1",
        "--pipeline-parallel-size", "1", "--num-gpu-blocks-override", "96", "--dtype", "half",
        "--max-model-len", "256", "--port", "8123", "--no-enable-lora"])
    assert config.model == llama_dir and args.port == 8123
    assert config.served_model_names() == ["tiny", "tiny-alias"]
    assert config.kv_allocator.model_dump() == {"name": "paged", "options": {"enable_prefix_caching": True}}
    assert config.scheduler.model_dump() == {
        "name": "fcfs", "options": {"chunked_prefill": True, "long_prefill_token_threshold": 64}}
    assert config.kv_cache_dtype == "fp8_e4m3" and config.dtype == "float16" and config.compile == "off"
    assert config.cuda_graph_sizes == []  # enforce_eager: no CUDA graphs either
    assert config.speculative.model_dump() == {
        "proposer": {"name": "ngram", "options": {"max_ngram": 4, "min_ngram": 2}}, "num_speculative_tokens": 3}
    assert (config.swap_space_gb, config.num_kv_blocks, config.max_model_len) == (2.0, 96, 256)

    config, _ = resolve(["generate", llama_dir, "--prompt", "x", "--scheduling-policy", "priority",
                         "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(3 * 2**29),
                         "--guided-decoding-backend", "xgrammar"])
    assert config.scheduler.name == "priority" and config.grammar_backend.name == "xgrammar"
    assert config.kv_allocator.options == {"enable_prefix_caching": False} and config.kv_cache_memory_gb == 1.5


def test_a_vllm_yaml_config_resolves_and_gives_the_server_its_port(llama_dir, tmp_path, caplog):
    path = tmp_path / "vllm.yaml"
    path.write_text(f"model: {llama_dir}\ntensor-parallel-size: 1\nenable-prefix-caching: false\n"
                    "max-model-len: 256\nkv_cache_dtype: fp8\nport: 8124\nhost: 0.0.0.0\ncompile: off\n"
                    "num-gpu-blocks-override: 64\nscheduling-policy: priority\ntrust-remote-code: true\n"
                    f"speculative-config: {{model: {llama_dir}, num_speculative_tokens: 2}}\n")
    with caplog.at_level(logging.WARNING, logger="modserve"):
        config, args = resolve(["serve", "--config", str(path), "--host", "127.0.0.2"])
    assert (args.host, args.port) == ("127.0.0.2", 8124)  # the command line wins over the file
    assert config.kv_allocator.options == {"enable_prefix_caching": False} and config.scheduler.name == "priority"
    assert (config.max_model_len, config.num_kv_blocks, config.kv_cache_dtype, config.compile) == \
        (256, 64, "fp8_e4m3", "off")
    assert config.speculative.proposer.model_dump() == {"name": "draft_model", "options": {"model": llama_dir}}
    assert "ignoring vLLM option trust_remote_code" in caplog.text
    # the front door's translation, in Python
    assert vllm_compat.engine_config({"model": llama_dir}, enable_prefix_caching=False).kv_allocator.options == \
        {"enable_prefix_caching": False}


def test_gpu_memory_utilization_is_vllms_share_of_total_memory(llama_dir, monkeypatch, caplog):
    from modserve.runner.quantization import planned_weight_bytes
    from transformers import AutoConfig
    import torch

    gib = 2**30
    monkeypatch.setattr(vllm_compat, "device_memory", lambda device: (10 * gib, 9 * gib))  # total, free
    with caplog.at_level(logging.INFO, logger="modserve"):
        config, _ = resolve(["serve", llama_dir, "--gpu-memory-utilization", "0.5", "--max-num-seqs", "8"])
    hf = AutoConfig.from_pretrained(llama_dir)
    weights = 2 * planned_weight_bytes(llama_dir, None, torch.float32, "cpu")  # counted twice on the CPU
    headroom = (2048 * (6 * hf.hidden_size + 3 * hf.intermediate_size) * 4 + 8 * hf.vocab_size * 12
                + vllm_compat.RUNTIME_HEADROOM_BYTES)
    assert config.kv_cache_memory_gb == pytest.approx((5 * gib - weights - headroom) / gib)
    assert "gpu_memory_utilization 0.5: KV cache" in caplog.text
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0\.95: .*more than the 9\.00 GiB free now"):
        resolve(["serve", llama_dir, "--gpu-memory-utilization", "0.95"])
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.01 leaves no KV cache"):
        resolve(["serve", llama_dir, "--gpu-memory-utilization", "0.01"])
    config, _ = resolve(["serve", llama_dir, "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "64"])
    assert (config.num_kv_blocks, config.kv_cache_memory_gb) == (64, None)  # an exact size wins


@pytest.mark.parametrize("argv, message", [
    (["--enable-sleep-mode"], "enable_sleep_mode=True is not supported: sleep mode is not supported"),
    (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype='fp8_e5m2' is not supported: the fp8 KV cache is e4m3"),
    (["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 4}'],
     "speculative_config keys not supported with method ngram: disable_by_batch_size"),
    (["--enforce-eager", "--compile", "on"], "enforce_eager contradicts compile: on"),
    (["--enforce-eager", "--cuda-graph-sizes", "8"], "enforce_eager contradicts cuda_graph_sizes: [8]"),
    (["--model", "/elsewhere"], "two models given"),
])
def test_what_modserve_lacks_is_a_clear_error(llama_dir, capsys, argv, message):
    # generate, not serve: were the option accepted, this returns instead of serving forever
    assert cli.main(["generate", llama_dir, "--prompt", "x", "--max-tokens", "1", "--num-kv-blocks", "128",
                     *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_vllms_parallelism_flags_are_modserves_settings(llama_dir, tmp_path):
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]):
        config, _ = resolve(["serve", llama_dir, *argv])
        assert (config.tensor_parallel_size, config.executor_choice().name) == (2, "mp")
    for key in ("tensor-parallel-size", "tensor_parallel_size"):  # a vLLM file's spelling, or modserve's
        path = tmp_path / "tp.yaml"
        path.write_text(f"model: {llama_dir}\n{key}: 2\ndistributed-executor-backend: ray\n")
        config, _ = resolve(["serve", "--config", str(path)])
        assert (config.tensor_parallel_size, config.executor_choice().name) == (2, "ray")
        config, _ = resolve(["serve", "--config", str(path), "-tp", "1", "--distributed-executor-backend", "uni"])
        assert (config.tensor_parallel_size, config.executor_choice().name) == (1, "uni")  # flags win
    # vLLM's refusals of -pp and -dp gave way to the fields of those names; the short flags stay
    config, _ = resolve(["serve", llama_dir, "-pp", "2", "-dp", "3"])
    assert (config.pipeline_parallel_size, config.data_parallel_size) == (2, 3)
    path.write_text(f"model: {llama_dir}\npipeline-parallel-size: 2\ndata_parallel_size: 3\n")
    config, _ = resolve(["serve", "--config", str(path)])
    assert (config.pipeline_parallel_size, config.data_parallel_size) == (2, 3)
    # and so did -dpb's: Ray placing the engine cores (server/ray_cores.py)
    assert resolve(["serve", llama_dir, "-dp", "2", "-dpb", "ray"])[0].data_parallel_backend == "ray"
    path.write_text(f"model: {llama_dir}\ndata-parallel-backend: ray\n")
    assert resolve(["serve", "--config", str(path)])[0].data_parallel_backend == "ray"
    assert resolve(["serve", llama_dir])[0].data_parallel_backend == "mp"
    # vLLM's --enable-expert-parallel is a bare flag, before or after the model; the file spells it either way
    for argv in (["serve", llama_dir, "-tp", "2", "--enable-expert-parallel"],
                 ["serve", "--enable-expert-parallel", llama_dir, "-tp", "2"]):
        config, _ = resolve(argv)
        assert (config.model, config.enable_expert_parallel) == (llama_dir, True)
    path.write_text(f"model: {llama_dir}\nenable-expert-parallel: true\n")
    assert resolve(["serve", "--config", str(path)])[0].enable_expert_parallel
    assert not resolve(["serve", "--config", str(path), "--no-enable-expert-parallel"])[0].enable_expert_parallel
    assert not resolve(["serve", llama_dir])[0].enable_expert_parallel


def test_hub_ids_say_modserve_needs_a_local_copy():
    with pytest.raises(ValueError, match="must be downloaded first: huggingface-cli download no-such-org/no-model"):
        vllm_compat.engine_config({"model": "no-such-org/no-model"})


def test_booleans_are_on_and_off(llama_dir, tmp_path):
    config, _ = resolve(["generate", llama_dir, "--prompt", "x", "--compile", "off", "--prepack-weights", "on"])
    assert (config.compile, config.prepack_weights) == ("off", "on")
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {llama_dir}\ncompile: on\nprepack_weights: false\n")
    config = config_from_file(path)
    assert (config.compile, config.prepack_weights) == ("on", "off")
    with pytest.raises(ValueError, match=r"compile: Input should be 'auto', 'on' or 'off' \(got 'of'\)"):
        EngineConfig.from_dict({"model": llama_dir, "compile": "of"})


@pytest.mark.parametrize("name, text, where", [
    ("bad.yaml", "model: x\nmax_num_seqs: 4\n  block_size: 16\n", "line 3, column 13: mapping values are not "
                                                                  "allowed here"),
    ("bad.yml", "scheduler: {name: fcfs\n", "line 2, column 1: expected ',' or '}', but got '<stream end>' "
                                            "(while parsing a flow mapping)"),
    ("bad.toml", 'model = "x"\nmax_num_seqs 4\n', "line 2, column 14: Expected '=' after a key in a key/value pair"),
])
def test_a_syntax_error_is_one_line_naming_file_line_and_column(tmp_path, capsys, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    assert cli.main(["generate", "--config", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: config file {path}: {where}\n"


def test_no_abbreviations_anywhere(capsys):
    for argv, abbreviated in ((["serve", "--max-num-seq", "4"], "--max-num-seq"),
                              (["bench", "throughput", "--num-prompt", "4"], "--num-prompt"),
                              (["plugins", "--log-lev", "debug"], "--log-lev"),
                              (["plan", "--model", "m", "--hard", "h100"], "--hard")):
        with pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args(argv)  # parse only: an accepted abbreviation must not start a server
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err

    def parsers(p: argparse.ArgumentParser):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    found = list(parsers(cli.build_parser()))
    assert len(found) > 8 and all(p.allow_abbrev is False for p in found)


def test_version_and_log_level_after_the_subcommand(capsys):
    from modserve import __version__

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"modserve {__version__}\n"
    parser = cli.build_parser()
    assert parser.parse_args(["plugins", "--log-level", "warning"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "debug", "bench", "serve", "--log-level", "error"]).log_level == "ERROR"
    assert not hasattr(parser.parse_args(["plugins"]), "log_level")  # main() makes it INFO
    assert "as they land" not in parser.format_help()


def test_help_shows_each_engine_flags_type_choices_and_default():
    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "--compile {auto,on,off} " in text and "(default: auto; booleans work too)" in text
    assert "--max-num-seqs INT Most sequences running at once (default: 128)" in text
    assert "--kv-allocator NAME|MAPPING KV block allocator plugin (default: paged)" in text
    assert "--tensor-parallel-size INT, -tp INT Ranks (processes, one device each)" in text
    assert "--pipeline-parallel-size INT, -pp INT " in text and "--data-parallel-size INT, -dp INT " in text
    assert "--num-threads INT, --threads INT" in text and "VALUE" not in text


# -- generate ---------------------------------------------------------------------------------------
def test_generate_without_a_model_uses_the_demo_model_and_labels_outputs(llama_dir, monkeypatch, capsys, caplog):
    import modserve.server.demo as demo

    monkeypatch.setattr(demo, "demo_model_dir", lambda: Path(llama_dir))  # the real one takes ~10 s to make
    with caplog.at_level(logging.INFO, logger="modserve"):
        rc = cli.main(["generate", "--prompt", "Hello", "--prompt", "The sky", "--max-tokens", "3",
                       "--num-kv-blocks", "128", "--log-level", "info"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(", Generated text: ")[0] for line in lines] == ["Prompt: 'Hello'", "Prompt: 'The sky'"]
    assert "using the demo model" in caplog.text
    assert ("selected: platform=cpu, model_architecture=LlamaForCausalLM, attention_backend=paged, "
            "kv_allocator=paged, scheduler=fcfs, sampler=default, quantizer=none, grammar_backend=auto, "
            "proposer=none") in caplog.text


def test_the_selection_line_names_a_third_party_distribution(llama_dir, caplog):
    from modserve.attention_backends.reference import ReferenceAttention

    plugin = types.SimpleNamespace(register_attention_backends=hookimpl(
        lambda register: register("fake-attn", lambda: ReferenceAttention)))
    get_registry().add_plugin(plugin, "fake", distribution="modserve-fake-attn", version="1.2")
    config = EngineConfig.from_dict({"model": llama_dir, "attention_backend": "fake-attn"})
    with caplog.at_level(logging.INFO, logger="modserve"):
        cli.log_selection(config)
    assert "attention_backend=fake-attn (modserve-fake-attn 1.2), kv_allocator=paged" in caplog.text


def test_llm_chat_uses_the_configured_chat_template(llama_dir, tmp_path):
    from modserve import LLM

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    for template in (str(path), TEMPLATE):  # a file, or inline Jinja
        llm = LLM(llama_dir, chat_template=template, num_kv_blocks=128, progress=False)
        assert llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
            == "<<user>>Hi\n<<assistant>>"
    with pytest.raises(ValueError, match="chat_template: '/no/such.jinja' is no Jinja template and no readable"):
        EngineConfig.from_dict({"model": llama_dir, "chat_template": "/no/such.jinja"})


# -- bench ------------------------------------------------------------------------------------------
def test_bench_takes_vllms_spellings(tmp_path):
    parser = cli.build_parser()
    a = parser.parse_args(["bench", "serve", "--dataset-name", "prefix_repetition", "--dataset-path", "d.json",
                           "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5",
                           "--prefix-repetition-suffix-len", "9", "--num-warmups", "0", "--host", "h",
                           "--port", "9", "--backend", "openai-chat", "--ignore-eos", "--save-result",
                           "--result-dir", str(tmp_path)])
    assert (a.workload, a.workload_path, a.input_len, a.output_len, a.range_ratio, a.suffix_len, a.warmups) == \
        ("prefix-repetition", "d.json", 24, 6, 0.5, 9, 0)
    from modserve.bench.cli import output_path

    assert Path(output_path(a, "serve")).parent == tmp_path
    a = parser.parse_args(["bench", "latency", "--num-iters", "5", "--num-iters-warmup", "2", "--threads", "1",
                           "--result-json", "r.json"])
    assert (a.repeats, a.warmups, a.cfg_num_threads, output_path(a, "latency")) == (5, 2, "1", "r.json")
    a = parser.parse_args(["plan", "--model", "m", "-tp", "8", "--kv-dtype", "fp8", "--memory-fraction", "0.8"])
    b = parser.parse_args(["plan", "--model", "m", "--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8",
                           "--gpu-memory-utilization", "0.8"])
    assert vars(a) == vars(b) and (a.tp, a.kv_dtype, a.memory_fraction) == (8, "fp8", 0.8)
    a = parser.parse_args(["compare", "a.yaml", "b.yaml", "--model", "m", "--max-num-seqs", "4",
                           "--enable-prefix-caching"])
    assert cli.engine_overrides(a) == {"model": "m", "max_num_seqs": 4, "enable_prefix_caching": True}


def test_bench_serve_with_vllms_flags_saves_its_result(llama_dir, tmp_path, capsys):
    from test_bench import _fake_server

    with _fake_server(0.001) as (url, state):
        host, port = url.removeprefix("http://").split(":")
        rc = cli.main(["bench", "serve", "--host", host, "--port", port, "--backend", "vllm", "--model", llama_dir,
                       "--served-model-name", "fake-model", "--dataset-name", "random", "--random-input-len", "8",
                       "--random-output-len", "3", "--num-prompts", "2", "--num-warmups", "0", "--repeats", "1",
                       "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
                       "--result-filename", "vllm-style.json"])
    assert rc == 0 and "completed 2, failed 0" in capsys.readouterr().out
    assert [(b["model"], b["max_tokens"]) for b in state["bodies"]] == [("fake-model", 3)] * 2
    assert len(json.loads((tmp_path / "vllm-style.json").read_text())["runs"]) == 1


# -- a server from a vLLM command line ----------------------------------------------------------------
def test_serve_a_vllm_command_line(tmp_path):
    from modserve.engine.tokenizer import Tokenizer
    from modserve.testing import cached_checkpoint

    model = str(cached_checkpoint())
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    server = launch(tmp_path, "vllm-flags", model, "--enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                    "--num-gpu-blocks-override", "64", "--max-model-len", "256", "-tp", "1",
                    "--served-model-name", "tiny", "tiny-alias", "--chat-template", str(template),
                    "--disable-log-requests", "--max-log-len", "100")
    try:
        wait_healthy(server, timeout=60)
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"]
        messages = [{"role": "user", "content": "Hi"}]
        r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny-alias", "messages": messages})
        assert r.status_code == 200, r.text
        expected = Tokenizer(model).encode("<<user>>Hi\n<<assistant>>", add_special_tokens=False)
        assert r.json()["tokens"] == expected  # the --chat-template, not the tokenizer's ChatML
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny-alias", "messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    finally:
        stop(server)
    log = server.log.read_text()
    assert "selected: platform=cpu, model_architecture=LlamaForCausalLM" in log
    assert "gpu_memory_utilization ignored: num_kv_blocks sizes the KV cache" in log
    # vLLM logs no requests by default either: only a setting modserve cannot honour warns
    assert "ignoring vLLM option max_log_len" in log and "disable_log_requests" not in log
    assert "KV cache: 64 blocks" in log


@pytest.mark.parametrize("argv, sizes", [
    (["--cuda-graph-sizes", "1", "2", "8"], [1, 2, 8]),  # vLLM's spelling: one value per size
    (["--cuda-graph-sizes", "[4, 16]"], [4, 16]),  # or one YAML list
    (["--cuda-graph-sizes"], []),  # none: capture nothing
    ([], None),  # unset: the platform's default sizes
])
def test_cuda_graph_sizes_on_the_command_line(llama_dir, argv, sizes):
    config, _ = resolve(["serve", llama_dir, *argv])
    assert config.cuda_graph_sizes == sizes


def test_vllms_kv_transfer_config_selects_the_connector(llama_dir):
    config, _ = resolve(["serve", llama_dir, "--kv-transfer-config", json.dumps({
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}, "kv_load_failure_policy": "fail"})])
    assert config.kv_connector.model_dump() == {"name": "shared_storage", "options": {"path": "/tmp/kv"}}
    assert (config.kv_role, config.kv_load_failure_policy) == ("producer", "fail")
    config, _ = resolve(["serve", llama_dir, "--kv-transfer-config",
                         '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
                         '{"cpu_bytes_to_use": 2147483648}}'])
    assert config.kv_connector.model_dump() == {"name": "host", "options": {"size_gb": 2.0}}
    assert config.kv_role == "both"
    with pytest.raises((ValueError, SystemExit)):
        resolve(["serve", llama_dir, "--kv-transfer-config", '{"kv_connector": "x", "kv_parallel_size": 2}'])
