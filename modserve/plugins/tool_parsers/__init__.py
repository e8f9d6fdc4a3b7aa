"""Built-in tool parsers, registered like any plugin's (imports nothing heavy)."""

from modserve.api import hookimpl


@hookimpl
def register_tool_parsers(register) -> None:
    register("hermes", "modserve.plugins.tool_parsers.hermes:HermesToolParser",
             description='<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks: Qwen2.5, Qwen3, QwQ, '
             "Hermes 2/3")
    register("llama3_json", "modserve.plugins.tool_parsers.llama3_json:Llama3JsonToolParser",
             description='{"name": ..., "parameters": ...} objects separated by ";", optionally after '
             "<|python_tag|>: Llama 3.1, 3.2, 3.3 with their JSON tool templates")
    register("mistral", "modserve.plugins.tool_parsers.mistral:MistralToolParser",
             description="[TOOL_CALLS] followed by a JSON list of calls: Mistral 7B v0.3, Mistral Nemo, Small")
    register("pythonic", "modserve.plugins.tool_parsers.pythonic:PythonicToolParser",
             description='a Python list of calls, [f(a=1), g(b="x")]: Llama 3.2 and Llama 4 with pythonic '
             "templates, ToolACE")
