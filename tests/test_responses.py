"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) with the official openai
client against real servers on the tiny Qwen2 checkpoint of test_tool_calling.py (Qwen2.5's
own tool-aware chat template). A request runs through the chat path, so its output is checked
against chat completions of the same messages, and its prompt against transformers' render.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from server_process import serving_together, wait_for

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                             "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}}]
ASK = "What is the weather in Paris?"
GREEDY = dict(model="tiny-qwen", temperature=0.0)
MAX_STORED = 3


@pytest.fixture(scope="module")
def servers(qwen_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses-servers")
    common = ["--model", qwen_dir, "--served-model-name", "tiny-qwen", "--num-kv-blocks", "128",
              "--max-model-len", "1024", "--max-stored-responses", str(MAX_STORED)]
    with serving_together(tmp, ("tools", [*common, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
                          ("thinking", [*common, "--reasoning-parser", "deepseek_r1"])) as servers:
        yield tuple(servers)


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return servers[0].client()


def summary(output) -> list[tuple]:
    """What an answer's output items say, ids left out: (type, text or (name, arguments))."""
    out = []
    for item in output:
        item = item if isinstance(item, dict) else item.model_dump()
        if item["type"] == "message":
            out.append(("message", "".join(p["text"] for p in item["content"])))
        elif item["type"] == "reasoning":
            out.append(("reasoning", "".join(p["text"] for p in item["content"])))
        else:
            out.append(("function_call", item["name"], item["arguments"]))
    return out


def reassemble(events) -> tuple[list[tuple], dict]:
    """A stream's events joined back into output items, checking their order and numbering."""
    events = [e.model_dump() for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    items: dict[int, dict] = {}
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items)
            items[e["output_index"]] = {**e["item"], "content": [], "arguments": "", "done": False}
            continue
        item = items[e["output_index"]]
        assert not item["done"] and e.get("item_id", item["id"]) == item["id"]
        if kind == "response.content_part.added":
            item["content"].append({"text": ""})
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            item["content"][e["content_index"]]["text"] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert item["content"][e["content_index"]]["text"] == e["text"]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert item["arguments"] == e["arguments"] and item["name"] == e["name"]
        elif kind == "response.output_item.done":
            item["done"] = True
            assert summary([e["item"]]) == summary([item])
        else:
            assert kind == "response.content_part.done", kind
    assert all(i["done"] for i in items.values())
    final = events[-1]["response"]
    assert summary(final["output"]) == summary([items[i] for i in sorted(items)])
    return summary(final["output"]), final


def test_text_output_is_the_chat_paths(client):
    kw = dict(max_output_tokens=8, **GREEDY)
    r = client.responses.create(input=ASK, instructions="Answer briefly.", **kw)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": ASK}], max_tokens=8, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.output[0].id.startswith("msg_")
    assert summary(r.output) == [("message", chat.choices[0].message.content)] and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # random text runs on
    # input as a list of message items with input_text parts: the same prompt
    listed = client.responses.create(input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
                                     instructions="Answer briefly.", **kw)
    assert summary(listed.output) == summary(r.output) and listed.usage.input_tokens == r.usage.input_tokens


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_enforced_tool_choice_returns_a_schema_valid_function_call(client, tool_choice):
    kw = dict(input=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=64,
              **GREEDY)
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["function_call"] and r.status == "completed"
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed, final = reassemble(client.responses.create(**kw, stream=True))
    assert streamed == summary(r.output) and final["status"] == "completed"
    with client.responses.stream(**kw) as stream:  # the client's own accumulator takes our events
        for _ in stream:
            pass
        assert summary(stream.get_final_response().output) == summary(r.output)


def test_text_format_json_schema_constrains_the_message(client):
    r = client.responses.create(input=ASK, max_output_tokens=64, text={"format": {
        "type": "json_schema", "name": "weather", "schema": WEATHER}}, **GREEDY)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_streamed_text_reassembles_to_the_answer(client):
    kw = dict(input=ASK, max_output_tokens=12, **GREEDY)
    r = client.responses.create(**kw)
    streamed, final = reassemble(client.responses.create(**kw, stream=True))
    assert streamed == summary(r.output)
    assert final["usage"]["output_tokens"] == r.usage.output_tokens and final["status"] == r.status


def test_a_follow_up_with_the_tool_result_continues_the_conversation(client, qwen_dir):
    first = client.responses.create(input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=64, **GREEDY)
    call = first.output[0]
    r = client.responses.create(previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "22 degrees, sunny"}], max_output_tokens=6, **GREEDY)
    # The prompt is the whole conversation through the template, the tool result in it.
    turns = [{"role": "user", "content": ASK},
             {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                 "name": call.name, "arguments": json.loads(call.arguments)}}]},
             {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees, sunny"}]
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    text = tok.apply_chat_template(turns, tools=CHAT_TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in text
    assert f'"arguments": {json.dumps(json.loads(call.arguments))}' in text
    assert r.usage.input_tokens == len(tok.encode(text, add_special_tokens=False))
    chat_turns = json.loads(json.dumps(turns))
    chat_turns[1]["tool_calls"][0]["function"]["arguments"] = call.arguments
    chat = client.chat.completions.create(messages=chat_turns, tools=CHAT_TOOLS, tool_choice="none", max_tokens=6,
                                          **GREEDY)
    assert r.output_text == chat.choices[0].message.content and r.previous_response_id == first.id


def test_retrieve_unknown_ids_and_the_store_bound(client, servers):
    made = [client.responses.create(input=f"Turn {i}", max_output_tokens=2, **GREEDY) for i in range(MAX_STORED + 1)]
    assert client.responses.retrieve(made[-1].id).model_dump() == made[-1].model_dump()
    for r in made[1:]:
        assert client.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError) as e:  # the oldest, evicted past max_stored_responses
        client.responses.retrieve(made[0].id)
    assert e.value.body["code"] == "response_not_found" and "max_stored_responses=3" in e.value.body["message"]
    unstored = client.responses.create(input="x", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert client.responses.retrieve(made[-1].id).id == made[-1].id  # store: false evicted nothing
    r = httpx.get(f"{servers[0].url}/v1/responses/resp_nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = httpx.post(f"{servers[0].url}/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_reasoning_items_with_a_reasoning_parser(servers):
    client = servers[1].client()
    kw = dict(input=ASK, max_output_tokens=10, **GREEDY)
    r = client.responses.create(**kw)
    # deepseek_r1 on random text: no </think>, so all of it is reasoning, as in chat
    chat = client.chat.completions.create(messages=[{"role": "user", "content": ASK}], max_tokens=10, **GREEDY)
    assert summary(r.output) == [("reasoning", chat.choices[0].message.reasoning_content)]
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 10
    streamed, _ = reassemble(client.responses.create(**kw, stream=True))
    assert streamed == summary(r.output)


@pytest.mark.parametrize("body,param,message", [
    ({"background": True}, "background", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search' tools are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type",
     "input_file content is not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "'item_reference' items are not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", ""),
    ({"prompt": {"id": "p"}}, "prompt", "unknown or unsupported field"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among the tools"),
])
def test_unsupported_fields_are_400_naming_them(servers, body, param, message):
    r = httpx.post(f"{servers[0].url}/v1/responses", json={"input": ASK, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_every_block_is_free_afterwards(servers):
    for server in servers:
        wait_for(lambda: server.metrics()["modserve_kv_blocks_used"] == 0)
        m = server.metrics()
        assert m["modserve_kv_blocks_free"] == m["modserve_kv_blocks_total"]
        assert m["modserve_num_requests_running"] == m["modserve_num_requests_waiting"] == 0
