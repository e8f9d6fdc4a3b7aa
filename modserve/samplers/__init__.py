"""Built-in samplers, registered through the ``modserve`` entry point like any plugin.

Registration imports nothing heavy: the target is a string, imported only when
the sampler is selected.
"""

from __future__ import annotations

from modserve.api import Register, hookimpl


@hookimpl
def register_samplers(register: Register) -> None:
    register(
        "default",
        "modserve.samplers.default:DefaultSampler",
        description="greedy, temperature, top-k/top-p/min-p, repetition/presence/frequency "
        "penalties and per-request seeds (vLLM semantics)",
    )


@hookimpl
def register_logits_processors(register: Register) -> None:
    register(
        "no_repeat_ngram",
        "modserve.samplers.no_repeat_ngram:NoRepeatNGram",
        description="a request's extra_args no_repeat_ngram_size n: never repeat an n-gram of its prompt and "
        "output (transformers' no_repeat_ngram_size)",
    )
