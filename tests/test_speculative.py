"""Speculative decoding: same greedy output, the target distribution kept, nothing leaked."""

from __future__ import annotations

import collections

import pytest
import torch

from modserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Repetitive text: the n-gram proposer finds matches, the model (random weights) often
# continues a repetition, so drafts get accepted.
PROMPTS = [
    "a b c d e f a b c d e f a b c d e f a b c",
    "the model token cache " * 6,
    "Hello there",
    "one two three one two three one two",
]


def make_llm(path: str, speculative=None, **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    overrides.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", progress=False, speculative=speculative, **overrides)


@pytest.fixture(scope="module")
def plain(llama_dir):
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def expected(plain):
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]


NGRAM = {"proposer": "ngram", "num_speculative_tokens": 4}


def test_ngram_greedy_identical(llama_dir, expected):
    llm = make_llm(llama_dir, NGRAM)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    stats = llm.engine.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    # fewer target forward passes than tokens: several tokens per step
    assert stats["steps"] < max(len(t) for t in expected) + 1


def test_draft_model_greedy_identical(llama_dir, checkpoint_dir, expected):
    # The target as its own draft agrees always; a different model disagrees often.
    for draft, agrees in ((llama_dir, True), (checkpoint_dir("llama", num_hidden_layers=1), False)):
        llm = make_llm(llama_dir, {"proposer": {"name": "draft_model", "options": {"model": draft}},
                                   "num_speculative_tokens": 3})
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
        stats = llm.engine.stats()
        rate = stats["spec_accepted_tokens"] / stats["spec_proposed_tokens"]
        assert (rate > 0.95) if agrees else (rate < 0.9), rate


def test_stop_strings_max_tokens_and_logprobs_with_speculation(llama_dir, plain):
    llm = make_llm(llama_dir, NGRAM)
    tok = plain.get_tokenizer()
    full = plain.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
    ):
        ref = plain.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
        if params.logprobs:
            for a, b in zip(got.logprobs, ref.logprobs):
                assert a["token_id"] == b["token_id"] and a["rank"] == b["rank"]
                assert abs(a["logprob"] - b["logprob"]) < 1e-4
    assert tok.decode(full.token_ids)


def test_logprobs_of_a_step_with_sampled_and_speculating_sequences(llama_dir, plain):
    """One step's output rows hold a sampled sequence's token and a speculating one's
    accepted drafts side by side; each request gets its own logprobs (or none), as without."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=k) for k in (3, None, 0, 1)]
    got = make_llm(llama_dir, NGRAM).generate(PROMPTS, params, use_tqdm=False)
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    for g, r in zip(got, ref):
        g, r = g.outputs[0], r.outputs[0]
        assert g.token_ids == r.token_ids
        assert (g.logprobs is None) == (r.logprobs is None)
        for a, b in zip(g.logprobs or [], r.logprobs or []):
            assert (a["token_id"], a["rank"], a["top"].keys()) == (b["token_id"], b["rank"], b["top"].keys())
            assert abs(a["logprob"] - b["logprob"]) < 1e-4
            assert all(abs(a["top"][t] - b["top"][t]) < 1e-4 for t in a["top"])


def test_no_blocks_leak_under_rejections_preemption_and_aborts(llama_dir):
    # a tight pool forces preemption mid-speculation; the leak guard checks after the test
    llm = make_llm(llama_dir, {"proposer": {"name": "draft_model",
                                            "options": {"model": llama_dir}}, "num_speculative_tokens": 4},
                   num_kv_blocks=10, max_model_len=160)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    eng = llm.engine
    eng.add_request("x", PROMPTS[1], params)
    for _ in range(4):
        eng.step()
    eng.abort_request("x")


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_001 = [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
            36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31]


def test_sampled_output_follows_target_distribution(llama_dir, checkpoint_dir):
    """Chi-square over (first, second) output tokens, where the second comes from
    verifying a draft that often disagrees, against the exact target probabilities
    p(t1) * p(t2 | t1), computed from full-vocabulary logprobs at the same temperature."""
    T = 0.1  # peaked enough that a few hundred samples fill the bins
    draft = checkpoint_dir("llama", num_hidden_layers=1)
    spec = make_llm(llama_dir, {"proposer": {"name": "draft_model", "options": {"model": draft}},
                                "num_speculative_tokens": 1})
    plain = make_llm(llama_dir, max_logprobs=2**20)  # the exact probabilities need every token's logprob
    V = plain.engine.runner.vocab_size
    prompt = plain.get_tokenizer().encode("the model token")

    def exact(ids: list[int]) -> dict[int, float]:
        out = plain.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=V), use_tqdm=False)
        top = out[0].outputs[0].logprobs[0]["top"]
        probs = torch.softmax(torch.tensor(list(top.values()), dtype=torch.float64) / T, 0)
        return dict(zip(top, probs.tolist()))

    n = 800
    p1 = exact(prompt)
    expected: dict[tuple, float] = {}
    for t1 in sorted(p1, key=p1.get, reverse=True)[:3]:
        p2 = exact(prompt + [t1])
        for t2 in sorted(p2, key=p2.get, reverse=True)[:4]:
            expected[(t1, t2)] = n * p1[t1] * p2[t2]
    expected = {k: e for k, e in expected.items() if e >= 5}  # the rest is pooled below
    expected[("rest",)] = n - sum(expected.values())

    params = [SamplingParams(temperature=T, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    outs = spec.generate([prompt] * n, params, use_tqdm=False)
    stats = spec.engine.stats()
    assert stats["spec_verifications"] > 0 and stats["spec_accepted_tokens"] < 0.9 * stats["spec_proposed_tokens"]
    counts = collections.Counter()
    for o in outs:
        pair = tuple(o.outputs[0].token_ids[:2])
        counts[pair if pair in expected else ("rest",)] += 1
    chi2 = sum((counts[k] - e) ** 2 / e for k, e in expected.items())
    df = len(expected) - 1
    assert df >= 4 and chi2 < CHI2_001[df], (chi2, df, counts, expected)


def test_guided_decoding_with_speculation(llama_dir):
    """The grammar checks drafts and rolls back: same constrained greedy output as without."""
    from modserve.core.structured_outputs import StructuredOutputs

    regex = r"(ab|cd){3,12}[0-9]{2}"
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(regex=regex))
    prompt = ["abcdabcdabcdabcd ab cd ab cd"]
    ref = make_llm(llama_dir).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    for backend in ("xgrammar", "outlines"):
        llm = make_llm(llama_dir, NGRAM, grammar_backend=backend)
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
        assert llm.engine.stats()["spec_proposed_tokens"] > 0, backend


def test_through_the_server_greedy_identical(llama_dir, plain, tmp_path):
    """`modserve serve --speculative ...`: streamed and whole greedy text equal the
    engine's without speculation, for both proposers; several tokens may share a chunk."""
    from server_process import launch, stop_all, wait_healthy

    prompt = PROMPTS[0]
    expected = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
    specs = {"ngram": "{proposer: ngram, num_speculative_tokens: 4}",
             "draft": f"{{proposer: {{name: draft_model, options: {{model: {llama_dir}}}}}, "
                      "num_speculative_tokens: 3}"}
    # Both servers start at once: a start is mostly one process's imports, and there are 2 cores.
    servers = [launch(tmp_path, name, "--model", llama_dir, "--dtype", "float32", "--num-kv-blocks", "128",
                      "--max-model-len", "256", "--speculative", spec) for name, spec in specs.items()]
    try:
        for server in servers:
            wait_healthy(server, timeout=180)
            client = server.client()
            kwargs = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24, temperature=0,
                          extra_body={"ignore_eos": True})
            assert client.completions.create(**kwargs).choices[0].text == expected
            chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
            assert "".join(chunks) == expected
            assert server.metrics()["modserve_spec_accepted_tokens_total"] > 0
    finally:
        stop_all(*servers)
