"""lm-evaluation-harness against a real ``modserve serve``, end to end and offline.

Its ``local-completions`` model runs the tiny tasks of tests/data/lm_eval_tasks (local
JSONL): multiple choice and perplexity (loglikelihood requests: ``echo`` + ``logprobs`` on
/v1/completions, the prompt's logprobs) and a generation task. The loglikelihoods it logs
must equal transformers' log-softmax sums on the same random weights (float32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_process import launch, stop, wait_healthy

pytest.importorskip("lm_eval", reason="lm_eval is not installed: pip install -c constraints.txt -e '.[test]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"
TASKS = ["modserve_tiny_mc", "modserve_tiny_gen", "modserve_tiny_ppl"]
TOL = 1e-3


def lm_eval_command(base_url: str, checkpoint: str, output: Path) -> list[str]:
    """The command line docs/server.md gives (run from the repository root)."""
    return [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
            "--model_args", f"base_url={base_url}/v1/completions,model={MODEL},tokenizer={checkpoint},"
            "tokenizer_backend=huggingface,tokenized_requests=True,max_length=512",
            "--tasks", *TASKS, "--include_path", "tests/data/lm_eval_tasks",
            "--output_path", str(output), "--log_samples"]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    srv = launch(tmp_path_factory.mktemp("lm-eval"), "server", "--model", llama_dir, "--served-model-name", MODEL,
                 "--num-kv-blocks", "64", "--max-model-len", "512")
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop(srv)


def test_lm_eval_local_completions_matches_transformers(server, llama_dir, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    run = subprocess.run(lm_eval_command(server.url, llama_dir, tmp_path / "out"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]
    assert 0 <= metrics["modserve_tiny_mc"]["acc,none"] <= 1
    assert 0 <= metrics["modserve_tiny_gen"]["exact_match,none"] <= 1
    assert metrics["modserve_tiny_ppl"]["word_perplexity,none"] > 1

    def samples(task: str) -> list[dict]:
        [path] = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        return [json.loads(line) for line in path.read_text().splitlines()]

    # The oracle, with lm-eval's own tokenization of each (context, continuation).
    lm = get_model("local-completions")(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer=llama_dir,
                                        tokenizer_backend="huggingface", max_length=512)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()

    def transformers_loglikelihood(context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = context + continuation
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
        rows = lp[len(context) - 1 : len(ids) - 1]  # the rows predicting the continuation
        target = torch.tensor(continuation)
        return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())

    pairs = []
    for s in samples("modserve_tiny_mc"):
        for args, [[ll, greedy]] in zip(s["arguments"].values(), s["resps"]):
            pairs.append((args["arg_0"], args["arg_1"]))
            expected = transformers_loglikelihood(*lm._encode_pair(args["arg_0"], args["arg_1"]))
            assert float(ll) == pytest.approx(expected[0], abs=TOL) and (greedy == "True") == expected[1]
    assert len(pairs) >= 10
    assert len(samples("modserve_tiny_ppl")) == 2
    for s in samples("modserve_tiny_ppl"):  # one window each: the prefix token, then the whole text
        [[ll]] = s["resps"]
        expected = transformers_loglikelihood([lm.prefix_token_id], lm.tok_encode(s["target"]))
        assert float(ll) == pytest.approx(expected[0], abs=TOL)
    assert all(isinstance(r, str) for s in samples("modserve_tiny_gen") for [r] in s["resps"])

    # The model object called directly: the same values.
    direct = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs[:3])],
                              disable_tqdm=True)
    for (ll, _), pair in zip(direct, pairs):
        assert ll == pytest.approx(transformers_loglikelihood(*lm._encode_pair(*pair))[0], abs=TOL)
