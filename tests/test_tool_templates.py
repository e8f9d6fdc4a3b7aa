"""Tool calling through Llama-3.1's and Mistral's tool-aware chat templates, end to end.

One server per family, started together, on the tiny llama checkpoint whose tokenizer carries
the family's template as vLLM ships it for its parser (modserve.testing.chat_templates), with
``--enable-auto-tool-choice --tool-call-parser`` that parser. The tiny vocabulary is full
(4,096 ids, all the model's embeddings hold), so the templates' control tokens
(``<|start_header_id|>``, ``<|eot_id|>``, ``[INST]``, ``[TOOL_CALLS]``, ``[TOOL_RESULTS]``) are
not added as special tokens: they are ordinary text, encoded alike by the server and by
transformers; Mistral's turns end with the tokenizer's own EOS, a special token.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from modserve.testing.chat_templates import (LLAMA31_JSON_TEMPLATE, MISTRAL_PARALLEL_TEMPLATE, MISTRAL_V03_TEMPLATE,
                                             with_chat_template)
from server_process import serving_together
from test_tool_calling import ASK, TOOLS, calls_of, check_valid, reassemble

FAMILIES = {"llama3": (LLAMA31_JSON_TEMPLATE, "llama3_json"), "mistral": (MISTRAL_PARALLEL_TEMPLATE, "mistral")}
# A call written the family's way, forced by a regex: random weights write none of their own accord.
WRITTEN = {"llama3": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "unit": "c"\}\}',
           "mistral": r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                      r'"unit": "c"\}\}\]'}
# The ids of the calls each family's parser reads (auto): the server's, or Mistral's 9 characters.
ID_FORM = {"llama3": r"chatcmpl-tool-[0-9a-f]{32}", "mistral": r"[A-Za-z0-9]{9}"}
DATE = {"date_string": "26 Jul 2024"}  # Llama's template otherwise writes today's date
GREEDY = dict(temperature=0.0, max_tokens=100)


@pytest.fixture(scope="module")
def family_dirs(checkpoint_dir, tmp_path_factory) -> dict[str, str]:
    return {f: str(with_chat_template(checkpoint_dir("llama"), tmp_path_factory.mktemp(f), template))
            for f, (template, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def tokenizers(family_dirs):
    return {f: AutoTokenizer.from_pretrained(d) for f, d in family_dirs.items()}


@pytest.fixture(scope="module")
def servers(family_dirs, tmp_path_factory):
    specs = [(f, ["--model", family_dirs[f], "--served-model-name", f, "--num-kv-blocks", "256",
                  "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", parser])
             for f, (_, parser) in FAMILIES.items()]
    with serving_together(tmp_path_factory.mktemp("template-servers"), *specs) as started:
        yield dict(zip(FAMILIES, started))


def rendered(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """What transformers makes of a conversation with the tools: the text and its token ids."""
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, **DATE)
    return text, tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool_choice,finish", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
], ids=["required", "named"])
def test_enforced_tool_choice_through_the_familys_template(servers, tokenizers, family, tool_choice, finish):
    kw = dict(model=family, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": DATE}, **GREEDY)
    client = servers[family].client()
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(rendered(tokenizers[family], ASK)[1])  # the tools reached the template
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == finish
    calls = calls_of(choice.message)
    assert len(calls) == 1
    check_valid(calls)
    if tool_choice != "required":
        assert calls[0][0] == "get_weather"
    streamed = reassemble(client.chat.completions.create(**kw, stream=True))
    assert streamed == {"content": "", "reasoning_content": "", "tool_calls": calls, "finish_reason": finish}


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_reads_a_call_written_the_familys_way(servers, family):
    kw = dict(model=family, messages=ASK, tools=TOOLS, extra_body={
        "chat_template_kwargs": DATE, "structured_outputs": {"regex": WRITTEN[family]}}, **GREEDY)
    client = servers[family].client()
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    calls = calls_of(choice.message)
    assert [name for name, _ in calls] == ["get_weather"]
    assert re.fullmatch(ID_FORM[family], choice.message.tool_calls[0].id)
    check_valid(calls)
    streamed = reassemble(client.chat.completions.create(**kw, stream=True), ID_FORM[family])
    assert streamed == {"content": "", "reasoning_content": "", "tool_calls": calls, "finish_reason": "tool_calls"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_loop_renders_through_the_familys_template(servers, tokenizers, family):
    """user -> the server's own call -> its result -> the answer; the answer's prompt is token
    for token transformers' render of the same conversation."""
    client = servers[family].client()
    first = client.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, extra_body={"chat_template_kwargs": DATE},
                                           **GREEDY)
    [call] = first.choices[0].message.tool_calls
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    r = client.chat.completions.create(model=family, messages=turns, tools=TOOLS, temperature=0.0, max_tokens=4,
                                       extra_body={"chat_template_kwargs": DATE, "prompt_logprobs": 0})
    assert r.choices[0].finish_reason in ("stop", "length")
    # The template's input as the server hands it over: the arguments as a mapping (vLLM's way).
    as_template = json.loads(json.dumps(turns))
    as_template[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    text, expected = rendered(tokenizers[family], as_template)
    name = call.function.name
    if family == "llama3":
        assert f'<|start_header_id|>assistant<|end_header_id|>\n\n{{"name": "{name}", "parameters": ' in text
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "22 degrees, sunny"}<|eot_id|>' in text
        assert "Environment: ipython\n" in text
    else:
        assert f'[TOOL_CALLS] [{{"name": "{name}", ' in text and f'"id": "{call.id[-9:]}"}}]' in text
        assert f'[TOOL_RESULTS] {{"content": 22 degrees, sunny, "call_id": "{call.id[-9:]}"}}[/TOOL_RESULTS]' in text
    # prompt_logprobs name each prompt token the engine ran, all but the first
    served = [int(next(iter(position))) for position in r.prompt_logprobs[1:]]
    assert r.usage.prompt_tokens == len(expected) and served == expected[1:]


def test_mistrals_own_template_takes_the_mistral_parsers_ids(servers, tokenizers):
    """Mistral 7B v0.3's own template as a request's chat_template: the id of a call the mistral
    parser read renders, as transformers renders it; the server's own ids (``required``, longer)
    are a 400 with the template's words."""
    client = servers["mistral"].client()
    [call] = client.chat.completions.create(model="mistral", messages=ASK, tools=TOOLS, extra_body={
        "structured_outputs": {"regex": WRITTEN["mistral"]}}, **GREEDY).choices[0].message.tool_calls
    [server_call] = client.chat.completions.create(model="mistral", messages=ASK, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, **GREEDY).choices[0].message.tool_calls

    def turns(call_id: str, arguments) -> list[dict]:
        return ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                       "function": {"name": call.function.name, "arguments": arguments}}]},
                      {"role": "tool", "tool_call_id": call_id, "content": "22 degrees, sunny"}]

    url = f"{servers['mistral'].url}/v1/chat/completions"
    body = {"messages": turns(call.id, call.function.arguments), "tools": TOOLS, "max_tokens": 1,
            "chat_template": MISTRAL_V03_TEMPLATE}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = tokenizers["mistral"].apply_chat_template(turns(call.id, json.loads(call.function.arguments)), tools=TOOLS,
                                                     chat_template=MISTRAL_V03_TEMPLATE, tokenize=False)
    assert f'"id": "{call.id}"}}]' in text and f'"call_id": "{call.id}"}}[/TOOL_RESULTS]' in text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizers["mistral"].encode(text, add_special_tokens=False))
    r = httpx.post(url, json={**body, "messages": turns(server_call.id, call.function.arguments)}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert "Tool call IDs should be alphanumeric strings with length 9!" in err["message"]
