"""Prompt logprobs (``SamplingParams.prompt_logprobs``; completions' ``echo`` + ``logprobs``).

The oracle is transformers on the same random weights, in float32: each prompt token's
logprob is its log-softmax there, given the tokens before it. Checked for a plain
prefill, a chunked one, a prefix-cache hit, a batch where other requests don't ask,
n > 1 and recompute preemption mid-prefill; then the server's shapes through the
official openai client against a real ``modserve serve`` process.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_process import serving
from transformers import AutoModelForCausalLM, AutoTokenizer

from modserve import LLM, SamplingParams

TOL = 1e-4
MODEL = "tiny-llama"
TEXTS = [
    "The quick brown fox jumps over the lazy dog",
    "café naïve 日本語 😀 and then the model token cache, Zürich Kraków Málaga",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
]


@pytest.fixture(scope="module")
def hf(llama_dir):
    """(tokenizer, ids -> [P, V] float32 log-softmax of transformers' logits)."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def log_softmax(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                cache[key] = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
        return cache[key]

    return AutoTokenizer.from_pretrained(llama_dir), log_softmax


@pytest.fixture(scope="module")
def prompts(hf) -> list[list[int]]:
    ids = [hf[0].encode(t) for t in TEXTS]
    assert all(len(p) > 16 for p in ids) and len({len(p) for p in ids}) == len(ids)
    return ids


def rank_band(row: torch.Tensor, logprob: float) -> tuple[int, int]:
    """The ranks (1 = most likely) a token of ``logprob`` may have in ``row`` [V], up to
    ties within the tolerance: those clearly above it come first, those within it may."""
    return int((row > logprob + TOL).sum()) + 1, int((row > logprob - TOL).sum())


def check_entries(entries, ids: list[int], ref: torch.Tensor, num_top: int) -> None:
    """``entries`` (the engine's) against the oracle ``ref`` [P, V]."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e, row = entries[i], ref[i - 1]  # position i - 1's logits predict token i
        assert e["token_id"] == ids[i]
        assert abs(e["logprob"] - row[ids[i]].item()) < TOL, (i, e["logprob"], row[ids[i]].item())
        assert rank_band(row, e["logprob"])[0] <= e["rank"] <= rank_band(row, e["logprob"])[1]
        assert len(e["top"]) == num_top
        values, top_ids = row.topk(num_top + 1)
        for (t, lp), v in zip(e["top"].items(), values):
            assert abs(lp - v.item()) < TOL and abs(row[t].item() - lp) < TOL
        if num_top and (values[:-1] - values[1:]).min() > TOL:  # no near tie: the very ids
            assert list(e["top"]) == top_ids[:num_top].tolist()


def make_llm(path: str, **overrides) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    return LLM(path, dtype="float32", max_model_len=256, progress=False, **overrides)


def test_plain_prefill_matches_transformers(llama_dir, hf, prompts):
    llm = make_llm(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, ids in zip(outs, prompts):
        check_entries(out.prompt_logprobs, ids, hf[1](ids), 3)
        assert len(out.outputs[0].token_ids) == 3
    # 0: the prompt token's own logprob and rank only.
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    check_entries(out.prompt_logprobs, prompts[0], hf[1](prompts[0]), 0)


def test_max_tokens_0_scores_the_prompt_only(llama_dir, hf, prompts):
    llm = make_llm(llama_dir)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
    check_entries(out.prompt_logprobs, prompts[1], hf[1](prompts[1]), 2)
    with pytest.raises(ValueError, match="^max_tokens .*0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="^prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)


def test_chunked_prefill_matches_transformers(llama_dir, hf, prompts):
    llm = make_llm(llama_dir, max_num_batched_tokens=16,
                   scheduler={"name": "fcfs", "options": {"long_prefill_token_threshold": 5}})
    chunks, step = [], llm.engine.scheduler.step

    def recording_step(*args):
        scheduled = step(*args)
        chunks.extend(scheduled.num_new_tokens)
        return scheduled

    llm.engine.scheduler.step = recording_step
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    assert max(chunks) == 5 and chunks.count(5) >= sum(len(p) for p in prompts) // 5 - 3  # several steps each
    for out, ids in zip(outs, prompts):
        check_entries(out.prompt_logprobs, ids, hf[1](ids), 2)


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_prefix_cache_is_skipped_for_prompt_logprobs(llama_dir, hf, prompts, allocator):
    llm = make_llm(llama_dir, kv_allocator={"name": allocator, "options": {"enable_prefix_caching": True}})
    eng, ids = llm.engine, prompts[2] * 2  # 4 full blocks of 16 and more
    stats = eng.allocator.stats
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([ids], plain, use_tqdm=False)  # caches the prompt's full blocks
    hits, computed = stats()["prefix_hit_tokens"], eng.stats()["computed_tokens"]
    scored = [llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
              for _ in range(2)]
    assert stats()["prefix_hit_tokens"] == hits  # no hit was used: the prompt was computed in full...
    assert eng.stats()["computed_tokens"] - computed == 2 * (len(ids) + 1)
    check_entries(scored[0].prompt_logprobs, ids, hf[1](ids), 1)
    assert scored[0].prompt_logprobs == scored[1].prompt_logprobs  # ...and gave the same values twice
    llm.generate([ids], plain, use_tqdm=False)
    assert stats()["prefix_hit_tokens"] - hits == (len(ids) - 1) // 16 * 16  # plain requests still hit


def test_batched_beside_requests_that_do_not_ask(llama_dir, hf, prompts):
    llm = make_llm(llama_dir)
    rows: list[int] = []
    compute_logits = llm.engine.runner.model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    llm.engine.runner.model.compute_logits = recording
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert rows == [3, 3, 3, 3]  # the hot path: one row per sequence, never a prompt's
    rows.clear()
    eng = llm.engine
    asks = [None, 2, 0]
    for i, (ids, n) in enumerate(zip(prompts, asks)):
        eng.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                    prompt_logprobs=n))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    assert outs["0"].prompt_logprobs is None
    for i in (1, 2):
        check_entries(outs[str(i)].prompt_logprobs, prompts[i], hf[1](prompts[i]), asks[i])
    assert [outs[str(i)].outputs[0].token_ids for i in range(3)] == reference
    # The prefill: 3 sampled rows, and the prompt rows of the two that asked (not the first's).
    assert sorted(rows) == [3, 3, 3, 3, len(prompts[1]) + len(prompts[2]) - 2]


def test_n_samples_share_the_prompt_logprobs(llama_dir, hf, prompts):
    llm = make_llm(llama_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    check_entries(out.prompt_logprobs, prompts[0], hf[1](prompts[0]), 2)


def test_recompute_preemption_mid_prefill_neither_loses_nor_repeats(llama_dir, hf):
    # 8 blocks of 16: two growing decodes and a 60-token prompt prefilled 8 tokens a step;
    # the prompt, the newest, is preempted (recompute) part-way, again and again.
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=8, max_model_len=128, progress=False,
              kv_allocator={"name": "paged", "options": {"enable_prefix_caching": False}},
              scheduler={"name": "fcfs", "options": {"long_prefill_token_threshold": 8}})
    eng, ids = llm.engine, list(range(100, 160))
    preempted_at, preempt = [], eng.scheduler._preempt

    def recording(seq, out):
        if seq.request_id == "p":
            preempted_at.append(seq.num_computed_tokens)
        return preempt(seq, out)

    eng.scheduler._preempt = recording
    for i in range(2):
        eng.add_request(f"d{i}", list(range(10 + i, 30 + i)),
                        SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True))
    for _ in range(12):
        eng.step()
    eng.add_request("p", ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    assert any(0 < c < len(ids) for c in preempted_at), preempted_at  # part-way through its prefill
    check_entries(outs["p"].prompt_logprobs, ids, hf[1](ids), 1)


# -- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("prompt-logprobs"), "server", "--model", llama_dir,
                 "--served-model-name", MODEL, "--num-kv-blocks", "128", "--max-model-len", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def check_echo(lp, ids: list[int], ref: torch.Tensor, tok, num_top: int) -> None:
    """The prompt's part of completions' legacy ``logprobs``."""
    texts = [tok.decode([t]) for t in ids]
    assert lp.tokens[: len(ids)] == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(texts[i - 1])
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
        top = lp.top_logprobs[i]
        assert top[texts[i]] == lp.token_logprobs[i]  # the prompt token itself is always listed
        assert num_top <= len(top) <= num_top + 1
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=TOL)


def test_echo_logprobs_max_tokens_0(client, hf, prompts):
    tok, ref = hf
    text = TEXTS[1]
    r = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=2, max_tokens=0)
    c = r.choices[0]
    assert c.text == tok.decode(prompts[1]) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompts[1])
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompts[1])
    check_echo(lp, prompts[1], ref(prompts[1]), tok, 2)
    # The same prompt as token ids.
    by_ids = client.completions.create(model=MODEL, prompt=prompts[1], echo=True, logprobs=2, max_tokens=0)
    assert by_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs
    # Echo without logprobs and max_tokens 0: the prompt's text alone.
    plain = client.completions.create(model=MODEL, prompt=text, echo=True, max_tokens=0)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None


def test_echo_logprobs_then_the_generated_tokens(client, hf, prompts):
    tok, ref = hf
    greedy = dict(model=MODEL, temperature=0.0, max_tokens=4, logprobs=1, extra_body={"ignore_eos": True})
    alone = client.completions.create(prompt=TEXTS[0], **greedy).choices[0]
    r = client.completions.create(prompt=TEXTS[0], echo=True, n=2, **greedy)
    echo, P = tok.decode(prompts[0]), len(prompts[0])
    for c in r.choices:
        lp = c.logprobs
        assert c.text == echo + alone.text and len(lp.tokens) == P + 4
        check_echo(lp, prompts[0], ref(prompts[0]), tok, 1)
        assert lp.tokens[P:] == alone.logprobs.tokens
        assert lp.token_logprobs[P:] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-5)
        assert lp.text_offset[P] == len(echo)
    # Streamed: the echo (and its logprobs) first, then the tokens; joined, the same.
    chunks = list(client.completions.create(prompt=TEXTS[0], echo=True, stream=True, **greedy))
    assert chunks[0].choices[0].text == echo
    joined = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
              for x in ch.choices[0].logprobs.token_logprobs]
    assert joined == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_prompt_logprobs_field_on_completions_and_chat(server, client, hf, prompts):
    tok, ref = hf
    r = client.completions.create(model=MODEL, prompt=TEXTS[2], max_tokens=1, extra_body={"prompt_logprobs": 2})
    check_vllm_shape(r.choices[0].prompt_logprobs, prompts[2], ref(prompts[2]), tok, 2)
    assert r.choices[0].logprobs is None
    messages = [{"role": "user", "content": TEXTS[0]}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          extra_body={"prompt_logprobs": 1})
    check_vllm_shape(chat.prompt_logprobs, ids, ref(ids), tok, 1)
    assert "prompt_logprobs" not in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1).model_dump()


def check_vllm_shape(scored, ids: list[int], ref: torch.Tensor, tok, num_top: int) -> None:
    """vLLM's ``prompt_logprobs``: per token, id -> {logprob, rank, decoded_token}, the prompt's first."""
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        entry, row = scored[i], ref[i - 1]
        own = entry[str(ids[i])]
        assert list(entry)[0] == str(ids[i]) and own["decoded_token"] == tok.decode([ids[i]])
        assert abs(own["logprob"] - row[ids[i]].item()) < TOL
        assert rank_band(row, own["logprob"])[0] <= own["rank"] <= rank_band(row, own["logprob"])[1]
        values = row.topk(num_top).values
        others = [(int(k), v) for k, v in entry.items() if k != str(ids[i])]
        assert num_top <= len(entry) <= num_top + 1 and len({v["rank"] for _, v in others}) == len(others)
        for t, v in others:  # the top N, ranked 1..N
            assert 1 <= v["rank"] <= num_top and v["decoded_token"] == tok.decode([t])
            assert abs(v["logprob"] - row[t].item()) < TOL and abs(v["logprob"] - values[v["rank"] - 1].item()) < TOL


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),  # over max_logprobs (20)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1,
                              "stream": True}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_requests_are_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
