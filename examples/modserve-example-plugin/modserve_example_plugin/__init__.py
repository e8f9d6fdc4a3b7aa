"""modserve-example-plugin: one entry point that registers three implementations.

modserve imports this module whenever it starts (every engine, every ``modserve plugins``),
so it imports nothing heavy: targets and options are ``"module:Class"`` strings, imported
only when a config selects the implementation (its options also when ``modserve plugins``
lists them). A plugin imports from ``modserve.api`` only: the rest of modserve may change.
"""

from __future__ import annotations

from modserve.api import Register, hookimpl

# The plugin API this package is written against. A modserve that cannot provide it
# (another major version, or an older minor one) refuses it at load with a clear error
# instead of failing later in a step.
MODSERVE_PLUGIN_API = "1.0"


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("example_sdpa", "modserve_example_plugin.attention:ExampleSDPA",
             options="modserve_example_plugin.attention:ExampleSDPAOptions",
             description="example: per-sequence SDPA over the paged KV cache, GQA broadcast by SDPA")


@hookimpl
def register_schedulers(register: Register) -> None:
    register("shortest_first", "modserve_example_plugin.scheduler:ShortestFirstScheduler",
             options="modserve_example_plugin.scheduler:ShortestFirstOptions",
             description="example: running sequences first, then the shortest waiting prompt; "
             "anything waiting past max_wait_s goes first, oldest first")


@hookimpl
def register_samplers(register: Register) -> None:
    register("typical", "modserve_example_plugin.sampler:TypicalSampler",
             options="modserve_example_plugin.sampler:TypicalOptions",
             description="example: greedy, temperature, top-k/top-p/min-p, penalties and seeds, plus "
             "opt-in locally typical sampling (typical_p)")
