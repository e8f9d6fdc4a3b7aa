"""``modserve eval`` and compare's quality gates: the windows by hand, the numbers against
transformers on the same random weights (float32), offline against a real server."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch
from server_process import launch, stop, wait_healthy

from modserve.bench.evaluate import (Cloze, MultipleChoice, OfflineScorer, ServerScorer, TaskFileError, TokenScore,
                                     load_task, loglikelihood, perplexity, plain_encoder, rolling_windows,
                                     score_task, text_perplexity)
from modserve.cli import main
from modserve.core.hookspecs import hookimpl
from modserve.core.registry import get_registry

REL = 1e-4
WORDS = ("the of and a to in is was he for it with as his on be at by had are but from or have an they which "
         "one you were her all she there would their we him been has when who will more no if out so said").split()
TEXT = " ".join(WORDS[(7 * i * i + 3 * i) % len(WORDS)] for i in range(140))  # ~200 tokens
ENGINE = ["--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "512", "--attention-backend",
          "reference", "--threads", "1"]


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def llm(llama_dir):
    from modserve import LLM

    return LLM(llama_dir, dtype="float32", progress=False, num_kv_blocks=128, max_model_len=512)


def _log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]


# -- windows, pure python -----------------------------------------------------------------------
def _position_scorer(calls: list[list[int]]):
    """A fake model over tokens that are their own positions: token i's logprob is -i."""
    def score(token_lists):
        calls.extend(map(list, token_lists))
        return [[TokenScore(-float(t), True) for t in tokens[1:]] for tokens in token_lists]
    return score


@pytest.mark.parametrize("length,max_length,stride", [(10, 4, 2), (11, 4, 3), (17, 5, 1), (9, 9, 4), (5, 16, 8),
                                                      (40, 8, 7), (2, 2, 1)])
def test_windows_score_every_token_once_with_the_documented_context(length, max_length, stride):
    seq = list(range(length))
    windows = rolling_windows(seq, max_length, stride)
    scored: list[int] = []
    for k, w in enumerate(windows):
        assert 2 <= len(w.tokens) <= max_length and w.tokens == seq[k * stride:k * stride + len(w.tokens)]
        context = len(w.tokens) - w.num_scored
        assert context == (1 if k == 0 else max_length - stride)  # the first: only the unscored token 0
        scored += w.tokens[context:]
    assert scored == list(range(1, length))  # each once, in order; token 0 never
    calls: list[list[int]] = []
    result = perplexity(_position_scorer(calls), seq, max_length, stride)
    assert calls == [w.tokens for w in windows]  # one batch, every window
    assert (result.nll, result.num_tokens) == (sum(range(length)), length - 1)
    assert result.perplexity == pytest.approx(math.exp(result.nll / result.num_tokens))


def test_a_prefix_token_makes_the_first_token_scored():
    result = perplexity(_position_scorer([]), [1, 2, 3, 4], 3, 1, prefix_token=0)
    assert (result.nll, result.num_tokens) == (10, 4)


@pytest.mark.parametrize("args", [([0, 1, 2], 4, 4), ([0, 1, 2], 4, 0), ([0, 1, 2], 1, 1), ([0], 4, 2)])
def test_windows_refuse_what_would_leave_tokens_unscored(args):
    with pytest.raises(ValueError):
        rolling_windows(*args)


def test_loglikelihood_scores_exactly_the_continuation():
    calls: list[list[int]] = []
    ll = loglikelihood(_position_scorer(calls), [0, 1, 2], [3, 4])
    assert calls == [[0, 1, 2, 3, 4]] and ll.logprob == -7 and ll.greedy


# -- against transformers ------------------------------------------------------------------------
def hf_perplexity(model, ids: list[int], max_length: int, stride: int) -> tuple[float, int]:
    """Hugging Face's perplexity guide, with the loss summed per token instead of averaged."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        labels = torch.tensor(ids[begin:end])
        labels[: len(labels) - (end - prev_end)] = -100  # context only
        lp = _log_softmax(model, ids[begin:end])[:-1]  # row i predicts token i + 1
        target = labels[1:]
        keep = target != -100
        nll -= lp[keep].gather(1, target[keep][:, None]).sum().item()
        count += int(keep.sum())
        prev_end = end
        if end == len(ids):
            break
    return nll, count


@pytest.mark.parametrize("max_length,stride", [(64, 32), (50, 17), (512, 256)])
def test_perplexity_through_the_engine_equals_transformers(llm, hf, max_length, stride):
    model, tok = hf
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert 150 < len(ids) < 500
    result = text_perplexity(OfflineScorer(llm, batch_size=3), tok, TEXT, max_length, stride)
    nll, count = hf_perplexity(model, ids, max_length, stride)
    assert result["tokens"] == count == len(ids) - 1  # this tokenizer has no BOS: token 0 is unscored
    assert result["windows"] == (1 if max_length >= len(ids) else math.ceil((len(ids) - max_length) / stride) + 1)
    assert result["nll"] == pytest.approx(nll, rel=REL)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=REL)


def _mc_task(path: Path) -> Path:
    choices = [[" yes", " no", " maybe"], [" café", " cafe", " caffè"], [" red", " blue", " green", " naïve"],
               [" 1", " 22", " 333"], [" dog", " cat"]]
    lines = [{"context": f"Question {i}: which one? Answer:", "choices": c, "answer": i % len(c)}
             for i, c in enumerate(choices)]
    lines.append({"context": "Trailing space moves to the choice: ", "choices": ["a", "bb"], "answer": 1})
    path.write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\n")
    return path


def _hf_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    ctx = tok.encode(stripped, add_special_tokens=False)
    cont = tok.encode(stripped + continuation, add_special_tokens=False)[len(ctx):]
    lp = _log_softmax(model, ctx + cont)[len(ctx) - 1:-1]  # the rows predicting the continuation
    target = torch.tensor(cont)
    return lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())


def test_multiple_choice_equals_transformers(llm, hf, tmp_path):
    model, tok = hf
    examples = load_task(_mc_task(tmp_path / "mc.jsonl"))
    result = score_task(OfflineScorer(llm), plain_encoder(tok), examples)
    hits = hits_norm = 0
    for ex, row in zip(examples, result["per_example"]):
        expected = [_hf_loglikelihood(model, tok, ex.context, c)[0] for c in ex.choices]
        assert row["loglikelihoods"] == pytest.approx(expected, rel=REL)
        pick = max(range(len(expected)), key=expected.__getitem__)
        per_byte = [x / len(c.encode("utf-8")) for x, c in zip(expected, ex.choices)]
        pick_norm = max(range(len(per_byte)), key=per_byte.__getitem__)
        assert (row["pick"], row["pick_norm"]) == (pick, pick_norm)
        hits, hits_norm = hits + (pick == ex.answer), hits_norm + (pick_norm == ex.answer)
    assert (result["acc"], result["acc_norm"]) == (hits / len(examples), hits_norm / len(examples))


def test_cloze_equals_transformers(llm, hf, tmp_path):
    from modserve import SamplingParams

    model, tok = hf
    contexts = [f"Story {i}: once upon a time" for i in range(6)]
    greedy = llm.generate([tok.encode(c, add_special_tokens=False) for c in contexts],
                          SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    examples = [Cloze(context=c, continuation=g.outputs[0].text) for c, g in zip(contexts, greedy)]
    examples += [Cloze(context="Story: once upon a", continuation=" time there was")]
    result = score_task(OfflineScorer(llm), plain_encoder(tok), examples)
    expected = [_hf_loglikelihood(model, tok, ex.context, ex.continuation) for ex in examples]
    assert [r["loglikelihood"] for r in result["per_example"]] == pytest.approx([e[0] for e in expected], rel=REL)
    assert [r["greedy"] for r in result["per_example"]] == [e[1] for e in expected]
    assert any(e[1] for e in expected) and not all(e[1] for e in expected)
    assert result["acc"] == sum(e[1] for e in expected) / len(examples)


# -- offline and a real server ----------------------------------------------------------------------
def test_offline_and_server_scorers_agree(llm, llama_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    task = _mc_task(tmp_path / "mc.jsonl")
    srv = launch(tmp_path, "server", "--model", llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                 "--num-kv-blocks", "128", "--max-model-len", "512")
    try:
        wait_healthy(srv)
        for kind, args in (("perplexity", ["--text", str(text), "--max-length", "64", "--stride", "24"]),
                           ("task", [str(task)])):
            offline, served = tmp_path / f"{kind}-offline.json", tmp_path / f"{kind}-server.json"
            assert main(["eval", kind, *args, "--model", llama_dir, *ENGINE, "--output-json", str(offline)]) == 0
            assert main(["eval", kind, *args, "--base-url", srv.url, "--served-model-name", "tiny", "--tokenizer",
                         llama_dir, "--batch-size", "4", "--output-json", str(served)]) == 0
            a, b = json.loads(offline.read_text()), json.loads(served.read_text())
            if kind == "perplexity":
                assert (a["tokens"], a["windows"]) == (b["tokens"], b["windows"]) and a["windows"] > 3
                assert b["nll"] == pytest.approx(a["nll"], abs=1e-4)  # summed over every window
            else:
                assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
                for x, y in zip(a["per_example"], b["per_example"]):
                    assert y["loglikelihoods"] == pytest.approx(x["loglikelihoods"], abs=REL)
        # is_greedy from the echoed top_logprobs: the server's greedy flags equal the engine's ranks
        scorer = ServerScorer(srv.url, "tiny")
        from modserve import SamplingParams

        ids = llm.get_tokenizer().encode("Story 0: once upon a time", add_special_tokens=False)
        gen = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        [row] = scorer([ids + list(gen.outputs[0].token_ids)])
        assert all(s.greedy for s in row[len(ids) - 1:]) and not all(s.greedy for s in row[:len(ids) - 1])
    finally:
        stop(srv)


# -- task files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,message", [
    ('{"context": "a", "choices": [" b", " c"], "answer": 2}', "answer 2 is not an index of the 2 choices"),
    ('{"context": "a", "choices": [" b"], "answer": 0}', "choices: List should have at least 2 items"),
    ('{"context": "a", "continuation": " b", "extra": 1}', "extra: Extra inputs are not permitted"),
    ('{"context": "a"', "not JSON"),
    ('{"context": "a", "continuation": ""}', "continuation: String should have at least 1 character"),
    ('{"context": "  ", "continuation": " b"}', "context: Value error, the context is empty or only spaces"),
])
def test_a_bad_task_file_names_its_line(tmp_path, bad, message, capsys):
    path = tmp_path / "bad.jsonl"
    first = '{"context": "a", "choices": [" b", " c"], "answer": 0}' if "choices" in bad else \
        '{"context": "a", "continuation": " b"}'
    path.write_text(f"{first}\n\n{bad}\n")
    with pytest.raises(TaskFileError, match=f"bad.jsonl:3: .*{message}"):
        load_task(path)
    assert main(["eval", "task", str(path), "--model", "unused"]) == 2  # before any engine loads
    assert "bad.jsonl:3:" in capsys.readouterr().err
    config = tmp_path / "a.yaml"
    config.write_text("dtype: float32\n")
    assert main(["compare", str(config), str(config), "--model", "unused", "--eval-task", str(path)]) == 2
    assert "bad.jsonl:3:" in capsys.readouterr().err


def test_a_task_file_holds_one_kind(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"context": "a", "continuation": " b"}\n{"context": "a", "choices": [" b", " c"], "answer": 0}\n')
    with pytest.raises(TaskFileError, match="mixed.jsonl:2: a multiplechoice example in a file of cloze examples"):
        load_task(path)
    assert isinstance(load_task(_mc_task(tmp_path / "mc.jsonl"))[0], MultipleChoice)


# -- compare's quality gates ---------------------------------------------------------------------------
def noisy_attention():
    """A planted regression: the reference, its output perturbed by seeded noise (half its std)."""
    from modserve.attention_backends.reference import ReferenceAttention

    class Noisy(ReferenceAttention):
        def forward(self, q, k, v, kv_cache, meta, state):
            out = super().forward(q, k, v, kv_cache, meta, state)  # [T, H, D]
            noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
            return out + 0.5 * out.std() * noise

    return Noisy


@pytest.fixture
def quality_files(llm, tmp_path) -> tuple[Path, Path]:
    """A cloze task of the reference engine's own greedy continuations, and its greedy text:
    acc(reference) is high, a worse model's is lower; its perplexity is low, a worse model's higher."""
    from modserve import SamplingParams

    tok = llm.get_tokenizer()
    contexts = [f"Story {i}: once upon a time" for i in range(8)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([tok.encode(c, add_special_tokens=False) for c in contexts], params, use_tqdm=False)
    task = tmp_path / "cloze.jsonl"
    task.write_text("".join(json.dumps({"context": c, "continuation": o.outputs[0].text}) + "\n"
                            for c, o in zip(contexts, outs)))
    prompt = tok.encode("The", add_special_tokens=False)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    text = tmp_path / "greedy.txt"
    text.write_text("The" + llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text)
    return task, text


def _compare(tmp_path: Path, llama_dir: str, b: str, task: Path, text: Path) -> tuple[int, str]:
    paths = []
    for name, backend in (("a", "reference"), ("b", b)):
        path = tmp_path / f"{name}-{backend}.yaml"
        path.write_text(f"attention_backend: {backend}\ndtype: float32\nnum_kv_blocks: 128\nmax_model_len: 512\n")
        paths.append(str(path))
    rc = main(["compare", *paths, "--model", llama_dir, "--workload", "random", "--num-prompts", "2",
               "--input-len", "16", "--output-len", "4", "--repeats", "1", "--warmups", "0", "--probe-prompts", "1",
               "--min-agreement", "0", "--threads", "1", "--out-dir", str(tmp_path / "out"),
               "--eval-task", str(task), "--eval-text", str(text), "--eval-max-length", "48",
               "--min-task-accuracy-delta", "-0.02", "--max-perplexity-ratio", "1.02"])
    return rc, (tmp_path / "out" / "compare.md").read_text()


def test_compare_quality_gates_pass_on_identical_engines(llama_dir, tmp_path, quality_files):
    rc, report = _compare(tmp_path, llama_dir, "reference", *quality_files)
    assert rc == 0, report
    assert "## Quality" in report and "verdict: pass" in report
    assert "| acc | " in report and "+0.0000 |" in report and "B / A 1.0000" in report


def test_compare_quality_gates_fail_on_a_planted_regression(llama_dir, tmp_path, quality_files, capsys):
    plugin = types.SimpleNamespace(register_attention_backends=hookimpl(
        lambda register: register("noisy", noisy_attention)))
    get_registry().add_plugin(plugin, "test-noisy")  # the fresh_registry fixture forgets it
    rc, report = _compare(tmp_path, llama_dir, "noisy", *quality_files)
    assert rc == 1
    verdict = next(line for line in report.splitlines() if line.startswith("- verdict:"))
    assert "task accuracy gate: acc(B) - acc(A)" in verdict and "perplexity gate: ppl(B) / ppl(A)" in verdict
    assert "greedy agreement" not in verdict  # --min-agreement 0: only the quality gates failed
    assert "perplexity gate" in capsys.readouterr().err


@pytest.mark.parametrize("gate,needs", [("--min-task-accuracy-delta", "--eval-task"),
                                        ("--max-perplexity-ratio", "--eval-text")])
def test_a_gate_without_its_eval_file_is_an_error(tmp_path, gate, needs, capsys):
    config = tmp_path / "a.yaml"
    config.write_text("dtype: float32\n")
    assert main(["compare", str(config), str(config), "--model", "unused", gate, "0"]) == 2
    assert needs in capsys.readouterr().err


# -- a quantization regression that greedy agreement misses ------------------------------------------
PLANTED_PATH_ROWS = 128  # the planted kernel path: batches of more rows than this (long prefills)


def int8_with_a_broken_gemm_path():
    """A planted quantization bug of the kind kernels dispatch into: int8 exactly (the GEMV
    path, decode and short prompts) up to PLANTED_PATH_ROWS rows, but a GEMM path for bigger
    batches that reads the weights as ternary (-1, 0, 1 times max|W| per row)."""
    from modserve.quantizers.int8 import Int8

    class BrokenGemm(Int8):
        def process_weights(self, layer):
            super().process_weights(layer)
            w = self.dequantize(layer)  # [N, K]
            amax = w.abs().amax(dim=1, keepdim=True)
            layer.ternary = torch.nn.Parameter(torch.round(w / amax).clamp(-1, 1) * amax, requires_grad=False)

        def apply(self, layer, x):  # x: [T, K]
            if x.shape[0] <= PLANTED_PATH_ROWS:
                return super().apply(layer, x)
            return torch.nn.functional.linear(x, layer.ternary.to(x.dtype), layer.bias)

    return BrokenGemm


def test_compare_catches_a_quantization_regression_greedy_agreement_passes(tmp_path, capsys):
    """On the trained demo model, with its held-out task and text: int8 against int8 with a
    broken large-batch path. The workload's prompts are short, so every greedy token and every
    probed logit agrees (the default 0.9 agreement gate and a zero logit-difference gate pass),
    while scoring long prompts shows the damage: the task and perplexity gates fail."""
    from modserve.server.demo import DEMO_ROOT, demo_model_dir

    plugin = types.SimpleNamespace(register_quantizers=hookimpl(
        lambda register: register("int8-broken-gemm", int8_with_a_broken_gemm_path)))
    get_registry().add_plugin(plugin, "test-broken-gemm")  # the fresh_registry fixture forgets it
    task = tmp_path / "task.jsonl"
    task.write_text("".join((DEMO_ROOT / "heldout_cloze.jsonl").read_text().splitlines(True)[:40]))
    text = tmp_path / "heldout.txt"
    text.write_text("\n".join((DEMO_ROOT / "heldout.txt").read_text().splitlines()[:30]) + "\n")
    paths = []
    for name, quantizer in (("a", "int8"), ("b", "int8-broken-gemm")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"quantization: {quantizer}\ndtype: float32\nnum_kv_blocks: 256\nmax_model_len: 512\n")
        paths.append(str(path))
    rc = main(["compare", *paths, "--model", str(demo_model_dir()), "--workload", "random", "--num-prompts", "4",
               "--input-len", "16", "--output-len", "8", "--repeats", "1", "--warmups", "0", "--probe-prompts", "2",
               "--max-logit-diff", "0", "--threads", "1", "--out-dir", str(tmp_path / "out"),
               "--eval-task", str(task), "--eval-text", str(text), "--eval-max-length", "256",
               "--min-task-accuracy-delta", "-0.05", "--max-perplexity-ratio", "1.10"])
    report = (tmp_path / "out" / "compare.md").read_text()
    assert rc == 1, report
    assert "greedy exact match: 4/4 requests (100.0%)" in report
    verdict = next(line for line in report.splitlines() if line.startswith("- verdict:"))
    assert "task accuracy gate: acc(B) - acc(A)" in verdict and "perplexity gate: ppl(B) / ppl(A)" in verdict
    assert "greedy agreement" not in verdict and "logit" not in verdict
    assert "perplexity gate" in capsys.readouterr().err
