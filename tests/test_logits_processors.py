"""Logits processors (config ``logits_processors``, vLLM's ``--logits-processors``): the built-in
``no_repeat_ngram`` equal to transformers' ``generate(no_repeat_ngram_size=n)`` (float32 greedy, the
same tokens), a third party's processor registered through the plugin API acting only on the rows
that ask in a mixed batch, the server's ``vllm_xargs`` through the openai client, and the errors."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import PROMPTS
from modserve import LLM, SamplingParams
from modserve.api import BatchUpdate, LogitsProcessor, extra_arg, hookimpl
from modserve.core.registry import get_registry
from server_process import serving

STEPS = 24
CASES = [(PROMPTS[1], 2), (PROMPTS[4], 3), (PROMPTS[6], 2), (PROMPTS[0], 1), (PROMPTS[2], None)]  # None: no arg


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(llama_dir))


def hf_greedy(hf, prompt: str, n: int | None) -> list[int]:
    model, tok = hf
    ids = tok.encode(prompt)
    kw = {} if n is None else {"no_repeat_ngram_size": n}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def ngram_args(n: int | None) -> dict | None:
    return None if n is None else {"no_repeat_ngram_size": n}


def test_no_repeat_ngram_equals_transformers_in_one_batch(llama_dir, hf):
    with LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=128, progress=False,
             logits_processors=["no_repeat_ngram"]) as llm:
        params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, extra_args=ngram_args(n))
                  for _, n in CASES]
        outs = llm.generate([p for p, _ in CASES], params)
    changed = 0
    for (prompt, n), out in zip(CASES, outs):
        theirs = hf_greedy(hf, prompt, n)
        assert list(out.outputs[0].token_ids) == theirs, (prompt, n)
        changed += n is not None and theirs != hf_greedy(hf, prompt, None)
    assert changed >= 2, "the bans changed too few outputs for the comparison to mean anything"


# -- a third party's processor, registered through the plugin API in this test --------------------


class ForceToken(LogitsProcessor):
    """Rows whose request gives extra_args {"force_token": t} can only sample t. Records what
    update_state got, to check the engine's BatchUpdates."""

    examples = ({"force_token": 7},)
    updates: list[BatchUpdate | None] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forced: dict[int, int] = {}  # row -> token
        ForceToken.updates = []

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        t = extra_arg(params, "force_token")
        if t is not None and type(t) is not int:
            raise ValueError(f"extra_args.force_token must be a token id, got {t!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        ForceToken.updates.append(batch_update)
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.forced.pop(i, None)
        for i, params, _, _ in batch_update.added:
            t = extra_arg(params, "force_token")
            if t is None:
                self.forced.pop(i, None)
            else:
                self.forced[i] = t
        assert not batch_update.moved

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, t in self.forced.items():
            kept = logits[row, t].clone()
            logits[row] = float("-inf")
            logits[row, t] = kept
        return logits


class ThirdParty:
    @staticmethod
    @hookimpl
    def register_logits_processors(register) -> None:
        register("force_token", ForceToken, description="force a token where extra_args asks")


@pytest.fixture
def third_party():
    registry = get_registry()
    with registry.plugin(ThirdParty, "force-token-plugin"):
        yield registry


@pytest.mark.parametrize("how", ["registered name", "class"])
def test_a_plugin_processor_acts_on_its_rows_only(llama_dir, hf, third_party, how):
    """A mixed batch: the rows that give force_token get it at every step; the others are greedy
    as transformers is. The rows' BatchUpdates: added once each, then None while the batch stays."""
    from hf_oracle import greedy_and_logits

    choice = "force_token" if how == "registered name" else ForceToken  # the class: vLLM's LLM(logits_processors=[Cls])
    prompts = PROMPTS[:3]
    args = [None, {"force_token": 7}, None]
    with LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=128, progress=False,
             logits_processors=[choice]) as llm:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args=a)
                                      for a in args])
        with pytest.raises(ValueError, match="extra_args.force_token must be a token id"):
            llm.generate("x", SamplingParams(extra_args={"force_token": "seven"}))
    _, greedy, _ = greedy_and_logits(llama_dir, prompts, 8)
    assert list(outs[1].outputs[0].token_ids) == [7] * 8
    assert [list(outs[i].outputs[0].token_ids) for i in (0, 2)] == [greedy[0], greedy[2]]
    assert greedy[1] != [7] * 8
    first = next(u for u in ForceToken.updates if u is not None)
    assert sorted(a.index for a in first.added) == [0, 1, 2] and first.batch_size == 3
    assert [a.params.extra_args for a in sorted(first.added, key=lambda a: a.index)] == args
    assert ForceToken.updates[-1] is None  # the last steps ran the same three rows


class Recorder(LogitsProcessor):
    """Records the logits it is given; argmax-invariant or not as built."""

    def __init__(self, invariant: bool) -> None:
        self.invariant, self.seen = invariant, []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(logits.clone())
        return logits


def test_the_sampler_applies_processors_where_vllm_does():
    """Not argmax-invariant: after logit_bias, before penalties, greedy rows too. Argmax-invariant:
    after temperature, before top-k, and not at all when every row is greedy."""
    import dataclasses

    from modserve.samplers.default import DefaultSampler
    from modserve.testing.conformance.sampling_batches import batch

    sampler, logits = DefaultSampler(8), torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    bias = (torch.tensor([0]), torch.tensor([3]), torch.tensor([5.0]))
    biased = logits.clone()
    biased[0, 3] += 5.0
    for temperature in (0.0, 2.0):
        other, invariant = Recorder(False), Recorder(True)
        b = dataclasses.replace(batch(2, temperature=temperature, top_k=3), logit_bias=bias,
                                repetition_penalty=torch.tensor([3.0, 3.0]), any_penalty=True,
                                prompt_token_ids=torch.tensor([[3], [3]]), output_token_ids=torch.tensor([[8], [8]]),
                                logits_processors=(other,), argmax_invariant_processors=(invariant,))
        sampler(logits.clone(), b)
        assert len(other.seen) == 1 and torch.equal(other.seen[0], biased)  # biased, not yet penalised
        if temperature == 0.0:
            assert invariant.seen == []  # every row greedy: skipped
        else:
            penalised = torch.where(biased[:, 3:4] > 0, biased[:, 3:4] / 3.0, biased[:, 3:4] * 3.0)
            expected = torch.cat([biased[:, :3], penalised, biased[:, 4:]], dim=1) / temperature
            assert len(invariant.seen) == 1 and torch.allclose(invariant.seen[0], expected)
            assert torch.isfinite(invariant.seen[0]).all()  # before top-k masks anything


def test_an_unknown_processor_lists_the_available_ones(llama_dir, third_party):
    with pytest.raises(ValueError, match=r"unknown logits_processor 'nope'; available: force_token, no_repeat_ngram"):
        LLM(llama_dir, dtype="float32", num_kv_blocks=16, max_model_len=64, progress=False,
            logits_processors=["nope"])


def test_per_request_arguments_are_checked_offline(llama_dir):
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["no_repeat_ngram_size", 2])
    with LLM(llama_dir, dtype="float32", num_kv_blocks=16, max_model_len=64, progress=False,
             logits_processors=["no_repeat_ngram"]) as llm:
        with pytest.raises(ValueError, match="no_repeat_ngram_size must be a positive integer, got 0"):
            llm.generate("Hi", SamplingParams(extra_args={"no_repeat_ngram_size": 0}))


# -- the server: --logits-processors and vllm_xargs ----------------------------------------------


def test_server_vllm_xargs_reach_the_processor(llama_dir, hf, tmp_path):
    import httpx

    with serving(tmp_path, "lp", "--model", llama_dir, "--dtype", "float32", "--num-kv-blocks", "64",
                 "--max-model-len", "128", "--logits-processors", "no_repeat_ngram",
                 "--max-vllm-xargs-bytes", "100") as server:
        client = server.client()
        tok = hf[1]
        for prompt, n in CASES[:2]:
            r = client.completions.create(model=None, prompt=prompt, max_tokens=STEPS, temperature=0,
                                          extra_body={"vllm_xargs": {"no_repeat_ngram_size": n}, "ignore_eos": True})
            assert r.choices[0].text == tok.decode(hf_greedy(hf, prompt, n)), (prompt, n)
        chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Say it."}],
                                              max_tokens=4, temperature=0,
                                              extra_body={"vllm_xargs": {"no_repeat_ngram_size": 2}})
        assert chat.choices[0].finish_reason in ("length", "stop")
        base = {"prompt": "Hi", "max_tokens": 2}
        for body, param, words in [
            ({"vllm_xargs": {"no_repeat_ngram_size": 0}}, "vllm_xargs.no_repeat_ngram_size", "positive integer"),
            ({"vllm_xargs": {"a": "x" * 200}}, "vllm_xargs", "over max_vllm_xargs_bytes=100"),
            ({"vllm_xargs": {"a": {"b": 1}}}, "vllm_xargs.a", ""),
            ({"logits_processors": ["pkg.mod:Cls"]}, "logits_processors", "vLLM v1 refuses them too"),
        ]:
            r = httpx.post(f"{server.url}/v1/completions", json={**base, **body})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"].startswith(param) and words in error["message"], (body, error)
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "vllm_xargs": {"no_repeat_ngram_size": -1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.no_repeat_ngram_size", r.text
