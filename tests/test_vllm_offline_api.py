"""A vLLM offline script runs as written: vLLM's prompt forms, engine-argument names, import
paths, ``SamplingParams.clone()``, ``cumulative_logprob`` and the Hugging Face tokenizer."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from modserve import LLM, SamplingParams, cli, vllm_compat
from modserve.core.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT = "The quick brown fox"
TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, chat_template=TEMPLATE,
               progress=False)


def test_text_and_tokens_prompts_generate_as_the_same_prompt_given_plainly(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    prompts = [TEXT, {"prompt": TEXT}, {"prompt_token_ids": ids}, ids, {"prompt_token_ids": ids, "prompt": TEXT}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids] * 5
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [TEXT, TEXT, None, None, TEXT]  # a TokensPrompt's text, if it has one
    for one in ({"prompt": TEXT}, {"prompt_token_ids": ids}):  # one dict, not in a list
        (out,) = llm.generate(one, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts, error, message", [
    (42, TypeError, "prompts must be a str, a list of token ids, a TextPrompt"),
    ([TEXT, 1.5], TypeError, r"prompts\[1\] must be a str, a list of token ids, a TextPrompt"),
    ({"prompt": 3}, TypeError, r"prompts\['prompt'\] must be a str"),
    ([{"prompt_token_ids": [1, "2"]}], TypeError, "must be a list of integer token ids"),
    ([{"prompt_embeds": [[0.0]]}], ValueError, "EmbedsPrompt .* is not supported"),
    ([{"prompt": TEXT, "multi_modal_data": {"image": 1}}], ValueError, "multimodal inputs are not supported"),
    ([{"text": TEXT}], ValueError, "key 'text': modserve takes 'prompt' .* and 'prompt_token_ids'"),
], ids=["int", "float-in-list", "prompt-not-str", "ids-not-int", "embeds", "multimodal", "unknown-key"])
def test_other_prompt_forms_are_refused_at_the_call(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.requests


def test_vllm_engine_argument_names_mean_what_the_cli_makes_of_them(llama_dir, monkeypatch):
    # gpu_memory_utilization on a pretend device whose half leaves a 16 MiB KV cache
    plain = EngineConfig.from_dict({"model": llama_dir, "dtype": "float16", "max_model_len": 256})
    budget = vllm_compat.memory_budget(plain, 0.5)
    total = 2 * (budget.weights + budget.headroom + 16 * 2**20)
    monkeypatch.setattr(vllm_compat, "device_memory", lambda device: (total, total))
    llm = LLM(llama_dir, dtype="half", enforce_eager=True, enable_prefix_caching=False, swap_space=2,
              gpu_memory_utilization=0.5, max_model_len=256, progress=False)
    c = llm.config
    assert (c.dtype, c.compile, c.cuda_graph_sizes, c.swap_space_gb) == ("float16", "off", [], 2)
    assert c.kv_allocator.options == {"enable_prefix_caching": False}
    assert c.kv_cache_memory_gb == pytest.approx(16 / 1024)
    assert llm.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # what the CLI refuses, the keyword refuses with the same message
    with pytest.raises(ValueError) as offline:
        LLM(llama_dir, enable_sleep_mode=True, progress=False)
    with pytest.raises(ValueError) as command_line:
        cli.config_from_args(cli.build_parser().parse_args(["serve", llama_dir, "--enable-sleep-mode"]))
    assert str(offline.value) == str(command_line.value) == \
        "enable_sleep_mode=True is not supported: sleep mode is not supported"


def test_vllm_import_paths():
    import modserve
    from modserve.core import outputs
    from modserve.inputs import TextPrompt, TokensPrompt
    from modserve.outputs import CompletionOutput, RequestOutput
    from modserve.sampling_params import SamplingParams as VllmPathSamplingParams

    assert VllmPathSamplingParams is SamplingParams
    assert (RequestOutput, CompletionOutput) == (outputs.RequestOutput, outputs.CompletionOutput)
    top_level = ("TextPrompt", "TokensPrompt", "RequestOutput", "CompletionOutput")  # `from vllm import ...`
    assert tuple(getattr(modserve, name) for name in top_level) == (TextPrompt, TokensPrompt, RequestOutput,
                                                                     CompletionOutput)
    assert TextPrompt(prompt="x") == {"prompt": "x"}
    assert TokensPrompt(prompt_token_ids=[1]) == {"prompt_token_ids": [1]}


def test_sampling_params_clone_is_independent():
    params = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[3], structured_outputs={"regex": "a+"})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")
    copy.stop_token_ids.append(4)
    copy.max_tokens = 3
    assert (params.stop, params.stop_token_ids, params.max_tokens) == (["x"], [3], 16)
    assert copy.structured_outputs == params.structured_outputs
    assert copy.structured_outputs is not params.structured_outputs


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(llm):
    sampled = dict(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    c = llm.generate(TEXT, SamplingParams(**sampled, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    assert c.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in c.logprobs)) and c.cumulative_logprob < 0
    # without logprobs asked for, as vLLM: None
    assert llm.generate(TEXT, SamplingParams(**sampled), use_tqdm=False)[0].outputs[0].cumulative_logprob is None


def test_get_tokenizer_is_the_hugging_face_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerBase)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "<<user>>Hi\n<<assistant>>"
    assert tok(TEXT)["input_ids"] == llm.engine.tokenizer.encode(TEXT)
    assert tok.eos_token_id in llm.engine.tokenizer.eos_token_ids


def test_logprobs_come_in_vllms_shape(llm):
    """``logprobs[i][token_id]`` is a Logprob (logprob, rank, decoded_token): the sampled token
    and the top N with ranks 1..N; prompt_logprobs alike, the first None."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate(TEXT, params, use_tqdm=False)[0]
    c, tok = out.outputs[0], llm.get_tokenizer()
    assert len(c.logprobs) == len(c.token_ids) == 4
    for token_id, position in zip(c.token_ids, c.logprobs):
        sampled = position[token_id]
        assert sampled.rank == 1  # greedy
        assert sampled.decoded_token == tok.decode([token_id])
        assert sorted(lp.rank for lp in position.values()) == [1, 2] and 2 <= len(position) <= 3
        assert position["logprob"] == sampled.logprob  # modserve's own entry keys still answer
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    prompt = out.prompt_logprobs
    assert prompt[0] is None and len(prompt) == len(out.prompt_token_ids)
    second = prompt[1][out.prompt_token_ids[1]]
    assert second.logprob <= 0 and second.rank >= 1 and second.decoded_token == tok.decode([out.prompt_token_ids[1]])


def test_detokenize_false_gives_token_ids_only(llm):
    plain = llm.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=1)
    c = llm.generate(TEXT, params, use_tqdm=False)[0].outputs[0]
    assert (c.text, c.token_ids) == ("", plain.token_ids) and plain.text
    assert all(p[t].decoded_token is None for t, p in zip(c.token_ids, c.logprobs))
    with pytest.raises(ValueError, match="stop needs detokenize=True"):  # as vLLM: stop strings need text
        SamplingParams(detokenize=False, stop=["."])


def test_spaces_between_special_tokens_is_accepted_where_it_changes_nothing():
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be true with skip_special_tokens"):
        SamplingParams(spaces_between_special_tokens=False, skip_special_tokens=False)
