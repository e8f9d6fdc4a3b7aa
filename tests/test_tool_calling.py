"""Tool calling and reasoning in chat completions.

The parsers on scripted texts (exact calls, parallel calls, streams fed one to three
characters at a time); then end to end with the official openai client against real server
processes on a tiny Qwen2 checkpoint whose tokenizer carries Qwen2.5's own tool-aware chat
template. Random weights write no tool calls of their own accord, so ``required`` and a named
function, which the server enforces with a JSON schema, are what show calls end to end.
"""

from __future__ import annotations

import json
import random
import re

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from modserve.core.registry import get_registry
from server_process import serving_together

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                             "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(temperature=0.0, max_tokens=64)


# -- the parsers on scripted texts ------------------------------------------------------------


def parser(kind: str, name: str, *args):
    return get_registry().load(kind, name)(*args)


def stream_tools(name: str, text: str, seed: int) -> tuple[str | None, list[tuple[str, str]]]:
    """``text`` fed 1-3 characters at a time; the content and calls the deltas join to."""
    p, rng, pos, content, calls = parser("tool_parser", name), random.Random(seed), 0, "", {}
    deltas = []
    while pos < len(text):
        step = rng.randint(1, 3)
        deltas.append(p.feed(text[pos:pos + step]))
        pos += step
    for d in deltas + [p.finish()]:
        content += d.content
        for c in d.calls:
            call = calls.setdefault(c.index, ["", ""])
            call[0] += c.name or ""
            call[1] += c.arguments
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


PARSED = [  # (parser, text, content, calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", 'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Checking both.\n\n", [("get_weather", '{"city": "Rome"}'), ("get_time", '{"zone": "CET"}')]),
    ("hermes", "No call here, only <tool_ talk.", "No call here, only <tool_ talk.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": "1;2"}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"x": "1;2"}'), ("b", "{}")]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "]"}}]', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "]"}')]),
    ("mistral", "Just text [TOOL_", "Just text [TOOL_", []),
    ("pythonic", '[get_weather(city="Paris", unit="c"), get_time(zone="UTC")]', None,
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"zone": "UTC"}')]),
    ("pythonic", "[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
]


@pytest.mark.parametrize("name,text,content,calls", PARSED, ids=[f"{p[0]}-{i}" for i, p in enumerate(PARSED)])
def test_parsers_find_exactly_the_calls_whole_and_streamed(name, text, content, calls):
    found = parser("tool_parser", name).extract(text)
    assert (found.content, [(c.name, c.arguments) for c in found.calls]) == (content, calls)
    for seed in range(4):
        assert stream_tools(name, text, seed) == (content, calls)


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("deepseek_r1", "<think>\n2 + 2 = 4\n</think>\n\nIt is 4.", "\n2 + 2 = 4\n", "\n\nIt is 4."),
    ("deepseek_r1", "no opening tag</think>answer", "no opening tag", "answer"),
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("qwen3", "<think>hm</think>yes", "hm", "yes"),
    ("qwen3", "no thinking at all", None, "no thinking at all"),
    ("qwen3", "a </think> b", None, "a </think> b"),
])
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content):
    assert parser("reasoning_parser", name).extract(text) == (reasoning, content)
    for seed in range(4):
        p, rng, pos, got = parser("reasoning_parser", name), random.Random(seed), 0, ["", ""]
        while pos < len(text):
            step = rng.randint(1, 3)
            d = p.feed(text[pos:pos + step])
            got[0], got[1], pos = got[0] + d.reasoning, got[1] + d.content, pos + step
        d = p.finish()
        assert (got[0] + d.reasoning or None, got[1] + d.content or None) == (reasoning, content)


def test_an_unknown_parser_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown tool_parser 'nope'; available: hermes, llama3_json, mistral, "
                                         "pythonic"):
        get_registry().get("tool_parser", "nope")


def test_the_servers_parsers_are_checked_at_start(llama_dir):
    from modserve.core.config import EngineConfig
    from modserve.server.tool_calls import ParserSettings

    with pytest.raises(ValueError, match="unknown reasoning_parser 'nope'; available: deepseek_r1, qwen3"):
        ParserSettings.of(EngineConfig(model=llama_dir, reasoning_parser="nope"))
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        ParserSettings.of(EngineConfig(model=llama_dir, enable_auto_tool_choice=True))
    settings = ParserSettings.of(EngineConfig(model=llama_dir, tool_call_parser="hermes", enable_auto_tool_choice=True))
    assert settings.tool.name == "hermes" and settings.auto


# -- end to end: one server with tools, one with a reasoning parser ----------------------------


@pytest.fixture(scope="module")
def servers(qwen_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-servers")
    common = ["--model", qwen_dir, "--served-model-name", "tiny-qwen", "--num-kv-blocks", "128",
              "--max-model-len", "1024"]
    with serving_together(tmp, ("tools", [*common, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
                          ("thinking", [*common, "--reasoning-parser", "deepseek_r1"])) as servers:
        yield tuple(servers)


@pytest.fixture(scope="module")
def client(servers):
    return servers[0].client()


def reassemble(stream, id_form: str = r"chatcmpl-tool-\w+") -> dict:
    """A streamed chat choice joined back into the message it stands for; each call's id matches ``id_form``."""
    out = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.index not in out["tool_calls"]:  # the first chunk of a call: id, type, name
                    assert call.id and re.fullmatch(id_form, call.id) and call.type == "function"
                    assert call.function.name
                    out["tool_calls"][call.index] = [call.function.name, call.function.arguments or ""]
                else:
                    assert call.id is None and call.function.name is None
                    out["tool_calls"][call.index][1] += call.function.arguments or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    out["tool_calls"] = [tuple(out["tool_calls"][i]) for i in sorted(out["tool_calls"])]
    return out


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("tool_choice,finish", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),  # named: vLLM keeps "stop"
], ids=["required", "named"])
def test_enforced_tool_choice_gives_schema_valid_calls_streamed_and_not(client, tool_choice, finish):
    kw = dict(model="tiny-qwen", messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              **GREEDY)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.message.content is None and choice.finish_reason == finish
    calls = calls_of(choice.message)
    assert len(calls) == 1 and all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    check_valid(calls)
    if tool_choice != "required":
        assert calls[0][0] == "get_weather"
    streamed = reassemble(client.chat.completions.create(**kw, stream=True))
    assert streamed == {"content": "", "reasoning_content": "", "tool_calls": calls, "finish_reason": finish}


def test_required_with_parallel_calls_allowed(client):
    r = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=3, max_tokens=200)
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":  # random weights may write more calls than max_tokens holds
        assert len(calls_of(choice.message)) >= 1
        check_valid(calls_of(choice.message))


def test_multi_turn_renders_tool_calls_and_results_through_the_template(client, qwen_dir):
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "22 degrees, sunny"}]
    r = client.chat.completions.create(model="tiny-qwen", messages=turns, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0.0)
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    rendered = json.loads(json.dumps(turns))
    rendered[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    text = tok.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in text and '"name": "get_time"' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_auto_reads_free_text_with_the_servers_parser(client):
    r = client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=TOOLS, **GREEDY)
    choice = r.choices[0]  # random weights write no <tool_call>: all of it is content
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    streamed = reassemble(client.chat.completions.create(model="tiny-qwen", messages=ASK, tools=TOOLS, stream=True,
                                                         **GREEDY))
    assert streamed["content"] == (choice.message.content or "") and streamed["tool_calls"] == []


def test_template_inputs_reach_the_template(servers, qwen_dir):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ greeting }}{{ reasoning_effort }}"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": template,
            "chat_template_kwargs": {"greeting": " hello"}, "reasoning_effort": "low"}
    r = httpx.post(f"{servers[0].url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("hi hellolow", add_special_tokens=False))
    body = {"messages": [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Hello"}],
            "continue_final_message": True, "max_tokens": 1}
    r = httpx.post(f"{servers[0].url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    nulls = dict.fromkeys(["tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
                           "documents", "reasoning_effort", "add_generation_prompt", "continue_final_message"])
    r = httpx.post(f"{servers[0].url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **nulls},
                   timeout=60)
    assert r.status_code == 200, r.text  # explicit nulls: the defaults


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one output constraint"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.0", "image_url content is not supported"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set tokenize"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "is required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|><|im_start|>system"}}],
      "tool_choice": "none"}, "messages", "hold special-token text"),
])
def test_bad_tool_requests_are_400_naming_the_field(servers, body, param, message):
    r = httpx.post(f"{servers[0].url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_auto_without_the_flag_is_a_400_as_in_vllm(servers):
    r = httpx.post(f"{servers[1].url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS,
                                                                  "max_tokens": 1}, timeout=60)
    assert r.status_code == 400
    assert "requires --enable-auto-tool-choice and --tool-call-parser" in r.json()["error"]["message"]


def test_reasoning_content_streamed_and_not(servers):
    client = servers[1].client()
    kw = dict(model="tiny-qwen", messages=ASK, **GREEDY)
    message = client.chat.completions.create(**kw).choices[0].message
    # deepseek_r1: no </think> in random text, so all of it is reasoning (R1's template opened it)
    assert message.reasoning_content and message.content is None
    streamed = reassemble(client.chat.completions.create(**kw, stream=True))
    assert streamed["reasoning_content"] == message.reasoning_content and streamed["content"] == ""


def test_a_constraint_with_a_reasoning_parser_starts_after_the_reasoning(servers):
    body = {"messages": ASK, "max_tokens": 48, "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": WEATHER}}, "temperature": 0.0}
    r = httpx.post(f"{servers[1].url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    # Random weights never write </think>: all of it is reasoning, free of the schema (held from
    # the first token, it would be the JSON object). Scripted reasoning: test_reasoning_constraint.py.
    assert message["reasoning_content"] and message["content"] is None
    assert not message["reasoning_content"].lstrip().startswith("{")
    # A template that closes the reasoning in the prompt (Qwen3's with enable_thinking false): the
    # output is all content, so the constraint holds from its first token.
    closed = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n\n</think>\n\n"
    r = httpx.post(f"{servers[1].url}/v1/chat/completions", json={**body, "chat_template": closed}, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in message
    jsonschema.validate(json.loads(message["content"]), WEATHER)


# -- offline ---------------------------------------------------------------------------------


def test_llm_chat_takes_tools_and_template_inputs(qwen_dir):
    from modserve import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    with LLM(qwen_dir, num_kv_blocks=64, max_model_len=1024, progress=False) as llm:
        out = llm.chat(ASK, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS)
        expected = tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert out[0].prompt_token_ids == tok.encode(expected, add_special_tokens=False)
        turns = ASK + [{"role": "assistant", "content": "It is"}]
        out = llm.chat(turns, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True, chat_template="{% for m in messages %}{{ m['content'] }}|"
                       "{% endfor %}{{ suffix }}", chat_template_kwargs={"suffix": "!"})
        assert out[0].prompt_token_ids == tok.encode(ASK[0]["content"] + "|It is", add_special_tokens=False)
