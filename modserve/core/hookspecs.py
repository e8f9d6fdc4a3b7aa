"""The hooks a modserve plugin implements: one per kind of implementation.

Every hook receives ``register``, a callback owned by the host:

    register(name, target, *, options=None, description="")

- ``name``: the name users write in config (``attention_backend: paged``).
- ``target``: a ``"module:attribute"`` string (imported only when selected) or a
  zero-argument factory returning the class. Registration must import nothing heavy.
- ``options``: an optional pydantic model class, or ``"module:Class"`` string, that
  validates the implementation's options block from the config file.

One plugin may call ``register`` any number of times. Built-in implementations use
these very hooks, declared as entry points of the ``modserve`` group in pyproject.toml.
"""

from __future__ import annotations

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("modserve")
hookimpl = pluggy.HookimplMarker("modserve")

Register = Callable[..., None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.AttentionBackend` subclasses."""


@hookspec
def register_kv_allocators(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.KVAllocator` subclasses."""


@hookspec
def register_schedulers(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.Scheduler` subclasses."""


@hookspec
def register_quantizers(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.Quantizer` subclasses."""


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.GrammarBackend` subclasses."""


@hookspec
def register_samplers(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.Sampler` subclasses."""


@hookspec
def register_proposers(register: Register) -> None:
    """Register :class:`modserve.core.interfaces.Proposer` subclasses (speculative decoding)."""


@hookspec
def register_model_architectures(register: Register) -> None:
    """Register model classes under a Hugging Face ``architectures`` name
    (``"LlamaForCausalLM"``); the class follows :class:`modserve.core.interfaces.CausalLM`."""


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
}
