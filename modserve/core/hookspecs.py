"""The hooks a modserve plugin implements: one per kind of implementation.

Every hook receives ``register``, a callback owned by the host:

    register(name, target, *, options=None, description="", priority=None)

- ``name``: the name users write in config (``attention_backend: paged``).
- ``target``: a ``"module:attribute"`` string (imported only when selected) or a
  zero-argument factory returning the class. Registration must import nothing heavy.
- ``options``: an optional pydantic model class, or ``"module:Class"`` string, that
  validates the implementation's options block from the config file.
- ``priority``: an optional ``{key: int}``, higher first, for kinds where the core
  chooses among implementations itself: grammar backends give one per constraint kind
  (``{"json": 20, "regex": 10}``), and ``grammar_backend: auto`` tries them in that
  order (unlisted kinds count 0; ties by name).

One plugin may call ``register`` any number of times. Built-in implementations use
these very hooks, declared as entry points of the ``modserve`` group in pyproject.toml.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import pluggy
from pydantic import BaseModel

hookspec = pluggy.HookspecMarker("modserve")
hookimpl = pluggy.HookimplMarker("modserve")

# The plugin API's version (:mod:`modserve.api`): "major.minor". A minor release only adds;
# a major one may remove what the minor releases before it deprecated. A plugin declares the
# version it was written for as ``MODSERVE_PLUGIN_API = "1.0"`` on its entry-point object;
# the registry loads it when the major matches and its minor is not newer than ours.
PLUGIN_API_VERSION = "1.8"  # 1.1: kv_connector kind; 1.2: Quantizer.traceable; 1.3: native decode (CausalLM.
# decoder_layout, Quantizer.native_op, AttentionBackend.native_decode, GraphSettings.model); 1.4: GrammarBackend.
# serialize/deserialize; 1.5: block_keys, Platform.device_for_rank/shares_host_memory/pin_memory, logit_bias;
# 1.6: tool_parser and reasoning_parser kinds; 1.7: CheckpointTensor, as_tensor, CausalLM.reads_parts;
# 1.8: logits_processor kind, SamplingBatch.logits_processors, SamplingParams.extra_args; lora_resolver kind


class Register(Protocol):
    """The ``register`` callback every hook receives (see the module docstring)."""

    def __call__(self, name: str, target: str | Callable[[], Any], *,
                 options: type[BaseModel] | str | None = None, description: str = "",
                 priority: dict[str, int] | None = None) -> None: ...


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register :class:`modserve.core.contracts.attention_backend.AttentionBackend` subclasses."""


@hookspec
def register_kv_allocators(register: Register) -> None:
    """Register :class:`modserve.core.contracts.kv_allocator.KVAllocator` subclasses."""


@hookspec
def register_schedulers(register: Register) -> None:
    """Register :class:`modserve.core.contracts.scheduler.Scheduler` subclasses."""


@hookspec
def register_quantizers(register: Register) -> None:
    """Register :class:`modserve.core.contracts.quantizer.Quantizer` subclasses."""


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register :class:`modserve.core.contracts.grammar_backend.GrammarBackend` subclasses."""


@hookspec
def register_samplers(register: Register) -> None:
    """Register :class:`modserve.core.contracts.sampler.Sampler` subclasses."""


@hookspec
def register_proposers(register: Register) -> None:
    """Register :class:`modserve.core.contracts.proposer.Proposer` subclasses (speculative decoding)."""


@hookspec
def register_model_architectures(register: Register) -> None:
    """Register model classes under a Hugging Face ``architectures`` name
    (``"LlamaForCausalLM"``); the class follows :class:`modserve.core.contracts.model.CausalLM`."""


@hookspec
def register_platforms(register: Register) -> None:
    """Register :class:`modserve.core.contracts.platform.Platform` subclasses: a device type's dtype,
    memory, compile and linear-weight rules (``platform:``, default the ``device``'s type)."""


@hookspec
def register_executors(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.executor.Executor` classes: how tensor-parallel ranks
    beyond the engine's own get processes (``distributed_executor_backend: mp``, ``ray``)."""


@hookspec
def register_moe_backends(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.moe_backend.MoEBackend` classes: how a mixture-of-experts
    layer computes its routed experts (``moe_backend: reference``, ``fused``)."""


@hookspec
def register_kv_connectors(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.kv_connector.KVConnector` classes: where KV blocks go
    beyond this engine's cache (``kv_connector: shared_storage``, ``shm``, ``host``,
    ``mooncake``)."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.tool_parser.ToolParser` classes (``tool_call_parser: hermes``)."""


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.reasoning_parser.ReasoningParser` classes (``reasoning_parser``)."""


@hookspec
def register_lora_resolvers(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.lora_resolver.LoRAResolver` classes: where an adapter a
    request names but the server has not loaded is found (``lora_resolvers: [filesystem]``)."""


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register :class:`~modserve.core.contracts.logits_processor.LogitsProcessor` classes (``logits_processors``)."""


# kind -> hook name; the registry's single source of the kinds.
KIND_HOOKS: dict[str, str] = {
    "attention_backend": "register_attention_backends",
    "kv_allocator": "register_kv_allocators",
    "scheduler": "register_schedulers",
    "quantizer": "register_quantizers",
    "grammar_backend": "register_grammar_backends",
    "sampler": "register_samplers",
    "proposer": "register_proposers",
    "model_architecture": "register_model_architectures",
    "platform": "register_platforms",
    "executor": "register_executors",
    "moe_backend": "register_moe_backends",
    "kv_connector": "register_kv_connectors",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "lora_resolver": "register_lora_resolvers",
    "logits_processor": "register_logits_processors",
}
