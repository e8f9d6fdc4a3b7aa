"""vLLM's sampling surface, part 1: ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and
``truncate_prompt_tokens``, offline and through a real ``modserve serve`` process.

The oracles need no transformers: the engine's own raw logprobs of every token (they are of
the unprocessed logits, so ``argmax(logprob + bias)`` is what a biased greedy row must take),
the prompt token ids an output reports, and vLLM's documented bad-words rule restated here.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from server_process import Server, serving

from modserve import LLM, SamplingParams, StructuredOutputs
from modserve.core.sequence import Sequence

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog"
MAX_MODEL_LEN = 256


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 8, **kw})


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    # max_logprobs: the whole vocabulary, so a step's raw logprobs of every token can be read
    return LLM(llama_dir, dtype="float32", progress=False, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN,
               max_logprobs=1 << 20)


@pytest.fixture(scope="module")
def vocab(llm) -> int:
    return llm.engine.runner.vocab_size


def first_step_logprobs(llm: LLM, prompt: str | list[int], vocab: int) -> dict[int, float]:
    """Every token's raw logprob at the first generated position."""
    out = llm.generate([prompt], greedy(max_tokens=1, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    return out.logprobs[0]["top"]


def tokens(llm: LLM, prompt: str | list[int], params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


# -- logit_bias -------------------------------------------------------------------------------


def test_logit_bias_is_added_to_the_logits(llm, vocab):
    raw = first_step_logprobs(llm, PROMPT, vocab)
    ranked = sorted(raw, key=raw.get, reverse=True)
    top, low = ranked[0], ranked[5]
    gap = raw[top] - raw[low]
    for bias in ({low: gap + 0.5, top: -0.25}, {low: gap - 0.5}, {top: -(gap + 0.5), low: 0.0}):
        want = max(raw, key=lambda t: raw[t] + bias.get(t, 0.0))  # the oracle: argmax(logit + bias)
        out = llm.generate([PROMPT], greedy(max_tokens=1, logprobs=0, logit_bias=bias), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [want], (bias, want, out.token_ids)
        # logprobs stay those of the raw logits, as vLLM's default
        assert abs(out.logprobs[0]["logprob"] - raw[want]) < 1e-4


def test_logit_bias_100_forces_a_token_and_minus_100_bans_one(llm):
    forced = 1234
    assert tokens(llm, PROMPT, greedy(logit_bias={forced: 100.0})) == [[forced] * 8]
    (plain,) = tokens(llm, PROMPT, greedy())
    (banned,) = tokens(llm, PROMPT, greedy(logit_bias={plain[0]: -100.0}))
    assert banned[0] != plain[0]


# -- allowed_token_ids ------------------------------------------------------------------------


def test_allowed_token_ids_only_yields_them(llm, vocab):
    raw = first_step_logprobs(llm, PROMPT, vocab)
    ranked = sorted(raw, key=raw.get, reverse=True)
    a, b = ranked[40], ranked[900]  # two unlikely tokens
    (greedy_out,) = tokens(llm, PROMPT, greedy(max_tokens=12, allowed_token_ids=[a, b]))
    assert set(greedy_out) <= {a, b} and greedy_out[0] == a  # the likelier of the two first
    sampled = tokens(llm, PROMPT, SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=12, ignore_eos=True,
                                                  allowed_token_ids=[a, b]))
    assert all(set(s) <= {a, b} for s in sampled)


def test_rows_with_and_without_the_fields_share_a_batch(llm):
    """A request without the fields decodes as it does alone while others in its batch use them."""
    (alone,) = tokens(llm, PROMPT, greedy(max_tokens=12))
    params = [greedy(max_tokens=12, allowed_token_ids=[7, 9]), greedy(max_tokens=12),
              greedy(max_tokens=12, logit_bias={11: 100.0})]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert set(got[0]) <= {7, 9} and got[1] == alone and got[2] == [11] * 12


def test_rows_without_the_fields_get_no_tensors(llm, vocab):
    """The per-step cost of rows that ask for none of the fields: no bias entries, no mask, no bans."""
    runner = llm.engine.runner

    def seqs(*params: SamplingParams) -> list[Sequence]:
        return [Sequence(1000 + i, f"r{i}", [5, 6, 7], 3, p, 0.0) for i, p in enumerate(params)]

    plain = SamplingParams(temperature=0.0)
    batch = runner.sampling_batch(seqs(plain, plain))
    assert batch.logit_bias is None and batch.allowed_token_bitmask is None and batch.banned_token_ids == []
    asked = SamplingParams(temperature=0.0, logit_bias={7: 2.5}, allowed_token_ids=[7, 9, 31, 33])
    batch = runner.sampling_batch(seqs(plain, asked))
    rows, ids, biases = batch.logit_bias
    assert (rows.tolist(), ids.tolist(), biases.tolist()) == ([1], [7], [2.5])
    mask = batch.allowed_token_bitmask.cpu()  # [2, ceil(V / 32)] int32
    assert bool((mask[0] == -1).all())
    allowed = [t for t in range(vocab) if (int(mask[1, t // 32]) >> (t % 32)) & 1]
    assert allowed == [7, 9, 31, 33]


# -- bad_words --------------------------------------------------------------------------------


def bad_word_ids(tok, word: str) -> list[list[int]]:
    """vLLM's rule (SamplingParams.update_from_tokenizer), restated: the word alone, and after a
    space when that is another sequence of the same length."""
    alone = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])


def occurs(output: list[int], ids: list[int]) -> bool:
    """Whether ``ids`` appear within the output (a word whose start is in the prompt may)."""
    return any(output[i:i + len(ids)] == ids for i in range(len(output) - len(ids) + 1))


def word_in(tok, output: list[int], num_tokens: int) -> str:
    """A word of the output whose tokenization (by vLLM's rule) has ``num_tokens`` tokens and
    occurs in it: banning it must change the output."""
    for i in range(len(output) - num_tokens + 1):
        word = tok.decode(output[i:i + num_tokens]).strip()
        if word and any(len(w) == num_tokens and occurs(output, w) for w in bad_word_ids(tok, word)):
            return word
    raise AssertionError(f"no {num_tokens}-token word in {output}")


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_bad_words_are_never_generated(llm, num_tokens):
    tok = llm.get_tokenizer()
    (plain,) = tokens(llm, PROMPT, greedy(max_tokens=32))
    word = word_in(tok, plain, num_tokens)
    params = greedy(max_tokens=32, bad_words=[word])
    (out,) = tokens(llm, PROMPT, params)
    assert out != plain
    assert not any(occurs(out, ids) for ids in bad_word_ids(tok, word)), (word, bad_word_ids(tok, word), out)
    assert params.bad_words_token_ids is None  # the caller's SamplingParams is left as it was


def test_bad_words_with_sampling_and_n(llm):
    tok = llm.get_tokenizer()
    (plain,) = tokens(llm, PROMPT, greedy(max_tokens=32))
    words = [word_in(tok, plain, 1), word_in(tok, plain, 2)]
    outs = tokens(llm, PROMPT, SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=32, ignore_eos=True,
                                              bad_words=words))
    banned = [ids for w in words for ids in bad_word_ids(tok, w)]
    assert not any(occurs(o, ids) for o in outs for ids in banned)


# -- truncate_prompt_tokens --------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPT * 3)
    out = llm.generate([ids], greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == tokens(llm, ids[-5:], greedy())[0]
    text = llm.generate([PROMPT], greedy(truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert text.prompt_token_ids == tok.encode(PROMPT)[-4:] and text.prompt == PROMPT
    whole = llm.generate([ids], greedy(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # -1: max_model_len's worth, more than the prompt


def test_truncate_prompt_tokens_lets_a_long_prompt_run(llm):
    long = list(range(100, 100 + MAX_MODEL_LEN + 50))
    with pytest.raises(ValueError, match="longer than max_model_len"):
        llm.generate([long], greedy(), use_tqdm=False)
    out = llm.generate([long], greedy(truncate_prompt_tokens=100), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-100:] and len(out.outputs[0].token_ids) == 8


# -- with a grammar, with speculative decoding -------------------------------------------------


def test_allowed_token_ids_combine_with_a_grammar(llm, vocab):
    tok = llm.get_tokenizer()
    choice = StructuredOutputs(choice=["yes", "no"])
    first = llm.generate([PROMPT], SamplingParams(temperature=0.0, structured_outputs=choice),
                         use_tqdm=False)[0].outputs[0].text
    # Take away every token that could start the grammar's own pick: only the other one is left.
    allowed = [t for t in range(vocab) if not tok.decode([t]).startswith(first[0])]
    other = llm.generate([PROMPT], SamplingParams(temperature=0.0, structured_outputs=choice,
                                                  allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0].text
    assert {first, other} == {"yes", "no"}


def test_speculative_decoding_keeps_logit_bias_and_allowed_token_ids_exact(llm, llama_dir):
    prompt = "a b c d e f a b c d e f a b c d e f a b c"
    tok = llm.get_tokenizer()
    allowed = sorted(set(tok.encode(prompt)))
    params = [greedy(max_tokens=24, allowed_token_ids=allowed),
              greedy(max_tokens=24, logit_bias={allowed[0]: 3.0, allowed[1]: -3.0})]
    want = [o.outputs[0].token_ids for o in llm.generate([prompt] * 2, params, use_tqdm=False)]
    spec = LLM(llama_dir, dtype="float32", progress=False, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN,
               speculative={"proposer": "ngram", "num_speculative_tokens": 4})
    got = [o.outputs[0].token_ids for o in spec.generate([prompt] * 2, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.stats()["spec_accepted_tokens"] > 0  # these rows speculate: drafts were verified


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={1 << 20: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1 << 20]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=MAX_MODEL_LEN + 1), "truncate_prompt_tokens"),
])
def test_invalid_values_are_refused_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory) -> Server:
    with serving(tmp_path_factory.mktemp("surface"), "surface", "--model", llama_dir, "--served-model-name", MODEL,
                 "--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN), "--max-bad-words", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def token_id(server: Server, text: str) -> int:
    (tid,) = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return tid


def detokenize(server: Server, ids: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]


GREEDY = dict(model=MODEL, temperature=0.0, max_tokens=6)
CHAT = [{"role": "user", "content": "Say something."}]


def test_server_logit_bias(server, client):
    forced = 1234
    body = {"logit_bias": {str(forced): 100}, "extra_body": {"ignore_eos": True}}
    r = client.completions.create(prompt="Hello", **GREEDY, **body)
    assert r.choices[0].text == detokenize(server, [forced] * 6)
    r = client.chat.completions.create(messages=CHAT, **GREEDY, **body)
    assert r.choices[0].message.content == detokenize(server, [forced] * 6)


def test_server_allowed_token_ids_and_bad_words(server, client):
    x, y = token_id(server, "x"), token_id(server, "y")
    extra = {"allowed_token_ids": [x, y], "ignore_eos": True}
    text = client.completions.create(prompt="Hello", **GREEDY, extra_body=extra).choices[0].text
    assert re.fullmatch("[xy]{6}", text), text
    other = "y" if text[0] == "x" else "x"
    banned = client.completions.create(prompt="Hello", **GREEDY, extra_body={**extra, "bad_words": [text[0]]})
    assert banned.choices[0].text == other * 6
    chat = client.chat.completions.create(messages=CHAT, **GREEDY, extra_body={**extra, "bad_words": [text[0]]})
    assert chat.choices[0].message.content == other * 6


def test_server_truncate_prompt_tokens(server, client):
    ids = list(range(300, 330))
    r = client.completions.create(prompt=ids, echo=True, **GREEDY, extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5 and r.choices[0].text.startswith(detokenize(server, ids[-5:]))
    r = client.chat.completions.create(messages=CHAT, **GREEDY, extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4


@pytest.mark.parametrize("extra, field, why", [
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ({"allowed_token_ids": [999999]}, "allowed_token_ids", "vocabulary"),
    ({"bad_words": ["a", "b", "c", "d", "e"]}, "bad_words", "max_bad_words=4"),  # the server's --max-bad-words
    ({"bad_words": ["x" * 600, "y" * 600]}, "bad_words", "max_bad_words_chars=1024"),
    ({"bad_words": [""]}, "bad_words", "empty"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "max_model_len"),
    ({"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens", "max_model_len"),
])
def test_server_refuses_bad_values_naming_the_field(client, extra, field, why):
    for create in (lambda **kw: client.completions.create(prompt="Hello", **kw),
                   lambda **kw: client.chat.completions.create(messages=CHAT, **kw)):
        with pytest.raises(openai.BadRequestError) as e:
            create(**GREEDY, extra_body=extra)
        assert e.value.body["param"] == field and why in e.value.body["message"], e.value.body
