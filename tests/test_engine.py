"""Engine behaviour a user relies on: batching, preemption, sampling, stops, timings, errors."""

from __future__ import annotations

import pytest

from modserve import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Hello",
    "café naïve 日本語 😀 and then some more words here",
    "one two three four five six seven eight nine ten eleven twelve",
    "a b c",
    "model token cache batch queue layer server request stream memory block page kernel",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(path: str, **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    return LLM(path, dtype="float32", progress=False, **overrides)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def greedy_reference(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_preemption_keeps_greedy_output(llama_dir, greedy_reference):
    # 6 sequences growing to ~40 tokens need ~18 blocks of 16; 8 blocks force preemption.
    small = make_llm(llama_dir, num_kv_blocks=8, block_size=16, max_model_len=128)
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference


def test_small_token_budget_chunks_prefill(llama_dir, greedy_reference):
    small = make_llm(llama_dir, max_num_batched_tokens=5, block_size=4, max_model_len=256)
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference
    assert small.engine.counters["steps"] > GREEDY.max_tokens + 10  # prefills took several steps each


def test_max_num_seqs_one_runs_sequentially(llama_dir, greedy_reference):
    one = make_llm(llama_dir, max_num_seqs=1)
    outs = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference


def test_outputs_in_input_order_with_timings(llm):
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True)
                                  for i in range(len(PROMPTS))], use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.prompt == PROMPTS[i]
        assert len(out.outputs[0].token_ids) == 3 + i
        assert out.outputs[0].finish_reason == "length"
        m = out.metrics
        assert m.ttft is not None and m.ttft > 0
        assert len(m.token_times) == 3 + i
        assert all(x >= 0 for x in m.inter_token_latencies)


def test_seeded_request_reproduces_whatever_shares_its_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(PROMPTS[1:4] + [PROMPTS[0]] + PROMPTS[4:],
                         [others] * 3 + [seeded] + [others] * 2, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm, greedy_reference):
    params = SamplingParams(temperature=1.3, top_k=1, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference


def test_incremental_text_equals_full_decode(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=True)


def test_incremental_decoder_never_splits_a_character(llm):
    tok = llm.engine.tokenizer  # the engine's, with its streaming decoder
    text = "naïve 日本語 😀🚀 Øresund"
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # some token must end mid-character, or the test proves nothing
    assert any(p == "" for p in pieces)


def test_stop_string_truncates_and_finishes(llm, greedy_reference):
    tok = llm.get_tokenizer()
    full = tok.decode(greedy_reference[0], skip_special_tokens=True)
    stop = full[10:13]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    kept = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                     include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm, greedy_reference):
    target = greedy_reference[1][5]
    first = greedy_reference[1].index(target)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == greedy_reference[1][: first + 1]
    # min_tokens bans stop tokens until enough were generated
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, min_tokens=20,
                                                    stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 20 and target not in out.token_ids[:19]


def test_generation_config_eos_finishes_with_stop(llama_dir, greedy_reference, tmp_path):
    """EOS ids come from generation_config.json (a list): a copy of the checkpoint whose
    list holds a token the model greedily emits must stop there, without its text."""
    import json
    import shutil

    target = greedy_reference[1][4]
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], target]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = make_llm(str(model))
    c = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    cut = greedy_reference[1].index(target) + 1
    assert c.finish_reason == "stop" and c.token_ids == greedy_reference[1][:cut]
    assert c.text == llm.get_tokenizer().decode(greedy_reference[1][: cut - 1], skip_special_tokens=True)
    # ignore_eos runs past it
    c = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and c.token_ids == greedy_reference[1]


def test_logprobs(llm):
    import math

    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tid, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == tid and entry["rank"] == 1  # greedy takes the top token
        top = entry["top"]
        assert len(top) == 3 and max(top, key=top.get) == tid
        assert math.isclose(top[tid], entry["logprob"], abs_tol=1e-6)
        assert entry["logprob"] <= 0


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len(llama_dir):
    short = make_llm(llama_dir, max_model_len=32)
    good = short.generate(["hello"], GREEDY, use_tqdm=False)
    assert good[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate(["hello", "word " * 40], GREEDY, use_tqdm=False)
    assert not short.engine.requests  # the good prompt submitted with it was withdrawn


def test_generation_stops_at_max_model_len(llama_dir):
    short = make_llm(llama_dir, max_model_len=20)
    out = short.generate(["hello world"], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"


def test_bad_token_ids_and_empty_prompt(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], GREEDY, use_tqdm=False)


def test_engine_survives_bad_request_and_aborts_free_blocks(llm, greedy_reference):
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], GREEDY)
    eng.add_request("b", PROMPTS[1], GREEDY)
    eng.step()
    eng.step()
    assert eng.allocator.num_free_blocks() < eng.num_blocks
    out = eng.abort_request("a")
    assert out.outputs[0].finish_reason == "abort"
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("b", PROMPTS[2], GREEDY)
    results = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            results[o.request_id] = o
    assert results["b"].outputs[0].token_ids == greedy_reference[1]


def test_cli_generate(llama_dir, capsys):
    from modserve.cli import main

    rc = main(["generate", "--model", llama_dir, "--num-kv-blocks", "128", "--prompt", "Hello",
               "--max-tokens", "5"])
    assert rc == 0
    assert capsys.readouterr().out.strip()


def test_outputs_count_the_prompt_tokens_the_prefix_cache_held(llama_dir):
    """vLLM's RequestOutput.num_cached_tokens: whole blocks of the prompt found cached at admission."""
    llm = make_llm(llama_dir, num_kv_blocks=64, block_size=16, max_model_len=256)
    prompt = list(range(10, 60))  # 50 tokens: 3 full blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    [first] = llm.generate([prompt], greedy, use_tqdm=False)
    [again, other] = llm.generate([prompt + [7, 8], list(range(100, 120))], greedy, use_tqdm=False)
    assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, 48, 0)
    assert again.outputs[0].token_ids == llm.generate([prompt + [7, 8]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    logprobs = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)  # computes its whole prompt
    assert llm.generate([prompt], logprobs, use_tqdm=False)[0].num_cached_tokens == 0
