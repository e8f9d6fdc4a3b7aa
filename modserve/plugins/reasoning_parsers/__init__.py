"""Built-in reasoning parsers, registered like any plugin's (imports nothing heavy)."""

from modserve.api import hookimpl


@hookimpl
def register_reasoning_parsers(register) -> None:
    register("deepseek_r1", "modserve.plugins.reasoning_parsers.think:DeepSeekR1ReasoningParser",
             description="<think>...</think>; the text before </think> is reasoning even without <think> (R1's "
             "template writes it in the prompt): DeepSeek-R1 and its distills")
    register("qwen3", "modserve.plugins.reasoning_parsers.think:Qwen3ReasoningParser",
             description="<think>...</think> at the start of the output; without <think> all is content "
             "(enable_thinking off): Qwen3, QwQ")
