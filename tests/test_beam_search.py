"""Beam search (modserve/beam_search.py) as vLLM runs it: ``LLM.beam_search`` offline and
``use_beam_search`` on the server, equal to transformers' ``num_beams`` search on the same
float32 weights for fixed-length searches (the same beams, the same order, the same scores)."""

from __future__ import annotations

import pytest
import torch

from modserve import LLM
from modserve.beam_search import BeamSearch, beam_score
from modserve.sampling_params import BeamSearchParams
from server_process import Server, serving

PROMPTS = ["The quick brown fox", "café naïve 日本語"]
STEPS = 5
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(llama_dir))


def hf_beams(hf, prompt: list[int], width: int, length_penalty: float) -> list[tuple[list[int], float]]:
    """transformers' beams for ``STEPS`` tokens, best first: (new tokens, cum_logprob). EOS is an
    ordinary token (eos_token_id None), as modserve's with ignore_eos."""
    model, _ = hf
    with torch.no_grad():
        g = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                           max_new_tokens=STEPS, length_penalty=length_penalty, early_stopping=True,
                           eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    # sequences_scores: cum_logprob / generated_length ** length_penalty
    return [(seq[len(prompt):].tolist(), score * STEPS ** length_penalty)
            for seq, score in zip(g.sequences, g.sequences_scores.tolist())]


def assert_same_beams(ours: list[tuple[list[int], float]], theirs: list[tuple[list[int], float]]) -> None:
    assert [t for t, _ in ours] == [t for t, _ in theirs]  # the same beams in the same order
    assert [c for _, c in ours] == pytest.approx([c for _, c in theirs], abs=1e-4)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=128, progress=False)


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 0.5)])
def test_offline_beam_search_equals_transformers(llm, hf, width, length_penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=STEPS, ignore_eos=True, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    tok = hf[1]
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert len(out.sequences) == width
        assert all(s.tokens[:len(ids)] == ids and s.finish_reason == "length" for s in out.sequences)
        assert out.sequences[0].text == tok.decode(out.sequences[0].tokens)  # vLLM's: the prompt's text too
        assert len(out.sequences[0].logprobs) == STEPS and len(out.sequences[0].logprobs[0]) == 2 * width
        ours = [(s.tokens[len(ids):], s.cum_logprob) for s in out.sequences]
        assert_same_beams(ours, hf_beams(hf, ids, width, length_penalty))


def test_beams_share_their_prefix_blocks(llm, monkeypatch):
    """Each step's requests find their prompt's full KV blocks in the prefix cache (16 tokens a
    block): the beams share them instead of prefilling them again."""
    cached: list[list[int]] = []
    generate = llm.generate

    def counting(prompts, params, use_tqdm=True):
        outputs = generate(prompts, params, use_tqdm=use_tqdm)
        cached.append([o.num_cached_tokens for o in outputs])
        return outputs

    monkeypatch.setattr(llm, "generate", counting)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks
    llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
    assert [len(step) for step in cached] == [1, 3, 3, 3]
    assert all(n >= 32 for step in cached[1:] for n in step), cached


def test_offline_beam_search_bounds(llm):
    with pytest.raises(ValueError, match="beam_width must be at most max_logprobs/2=10"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens is too large: 200"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=200))
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)


def entry(choices: dict[int, float]) -> dict:
    """An engine logprob entry whose sampled token is the most likely of ``choices``."""
    top = dict(sorted(choices.items(), key=lambda kv: -kv[1]))
    first = next(iter(top))
    return {"token_id": first, "logprob": top[first], "rank": 1, "top": top}


EOS = 2


@pytest.mark.parametrize("length_penalty, best_first", [(0.0, "ended"), (1.0, "ended"), (2.0, "live")])
def test_ranking_counts_the_length_as_vllm(length_penalty, best_first):
    """A beam that ends on EOS after one token against one that lives on for two: which ranks
    first turns on length_penalty, with vLLM's length (the prompt's 3 tokens counted, EOS not:
    counting only the generated ones, as transformers does, ranks the live one first at 1.0)."""
    search = BeamSearch([5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty), EOS)
    search.advance([entry({EOS: -1.0, 10: -1.2, 11: -3.0, 12: -4.0})])
    assert [b.tokens[-1] for b in search.beams] == [10, 11] and len(search.completed) == 1
    search.advance([entry({20: -0.5, 21: -5.0}), entry({22: -5.0, 23: -6.0})])
    assert search.done
    best = search.best()
    # ended: -1.0 over 3 tokens; live [10, 20]: -1.7 over 5 tokens
    scores = {"ended": -1.0 / 3 ** length_penalty, "live": -1.7 / 5 ** length_penalty}
    assert beam_score([5, 6, 7, EOS], -1.0, EOS, length_penalty) == pytest.approx(scores["ended"])
    assert (best[0].finish_reason == "stop") == (best_first == "ended")
    assert best[0].cum_logprob == pytest.approx(-1.0 if best_first == "ended" else -1.7)
    assert len(best) == 2 and search.output_tokens(best[0 if best_first == "ended" else 1]) == []


@pytest.mark.parametrize("include, shown", [(False, [10]), (True, [10, EOS])])
def test_an_ended_beam_shows_its_eos_only_when_asked(include, shown):
    params = BeamSearchParams(beam_width=1, max_tokens=3, include_stop_str_in_output=include)
    search = BeamSearch([5], params, EOS)
    search.advance([entry({10: -0.1, 11: -5.0})])
    search.advance([entry({EOS: -0.1, 12: -9.0})])
    search.advance([entry({13: -9.0, 14: -9.5})])
    (best,) = search.best()
    assert (best.finish_reason, best.stop_reason, best.tokens) == ("stop", EOS, [5, 10, EOS])
    assert search.output_tokens(best) == shown


# -- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Server:
    with serving(tmp_path_factory.mktemp("beam"), "beam", "--model", llama_dir, "--dtype", "float32",
                 "--num-kv-blocks", "128", "--max-model-len", "128") as s:
        yield s


@pytest.mark.parametrize("width", [2, 4])
def test_server_beam_search_equals_transformers(server, hf, width):
    client = server.client()
    r = client.completions.create(model=None, prompt=PROMPTS, n=width, max_tokens=STEPS, temperature=0,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    tok = hf[1]
    assert len(r.choices) == 2 * width and r.usage.completion_tokens == 2 * width * STEPS
    for i, prompt in enumerate(PROMPTS):
        expected = hf_beams(hf, tok.encode(prompt), width, 1.0)
        choices = r.choices[i * width:(i + 1) * width]
        assert [c.index for c in choices] == list(range(i * width, (i + 1) * width))
        assert [c.text for c in choices] == [tok.decode(t) for t, _ in expected]
        assert all(c.finish_reason == "length" for c in choices)
    prompt = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    r = client.chat.completions.create(model=None, messages=CHAT, n=width, max_tokens=STEPS, temperature=0,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.message.content for c in r.choices] == [tok.decode(t) for t, _ in hf_beams(hf, prompt, width, 1.0)]


@pytest.mark.parametrize("body, param", [
    ({"stream": True}, "stream"),
    ({"logprobs": 2}, "logprobs"),
    ({"stop": ["."]}, "stop"),
    ({"n": 11}, "n"),  # 2 * 11 logprobs per step: over max_logprobs=20
    ({"max_tokens": 200}, "max_tokens"),
    ({"length_penalty": 11.0}, "length_penalty"),  # 1e6 ** 11 would overflow
])
def test_server_beam_search_refusals(server, body, param):
    import httpx

    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "use_beam_search": True, "n": 2,
                                                          "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- best_of and logits_processors: vLLM removed both; refused, never ignored ------------------------


def test_best_of_may_only_equal_n(server):
    import httpx

    body = {"prompt": "Hi", "max_tokens": 2, "n": 2, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "best_of": 2}).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert "it may only equal n" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "best_of": 1})
    assert r.status_code == 400 and "best_of" in r.text  # chat never had it


def test_per_request_logits_processors_are_refused():
    from modserve import SamplingParams

    for name in ("logits_processors", "best_of"):  # as current vLLM's SamplingParams: no such keyword
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: [lambda ids, logits: logits] if name == "logits_processors" else 2})
