"""The LoRA resolver's contract (config key ``lora_resolvers``): finds an adapter that a request
names but the server has not loaded (vLLM's ``LoRAResolver``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pydantic import BaseModel

from modserve.core.lora_request import LoRARequest


class LoRAResolver(ABC):
    """Maps an adapter name to a PEFT adapter directory, for a server with ``enable_lora`` and
    run-time updates allowed (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

    Contract: ``resolve`` returns a :class:`LoRARequest` whose ``lora_name`` is the name asked
    and whose ``lora_path`` is a local directory holding the adapter (a resolver that downloads
    does so before it returns), or None when it does not know the name. It raises ValueError,
    saying why, when it knows the name but refuses it (an adapter of another base model): the
    client gets that reason in a 400. It never resolves a name to something outside its own
    source (``../x``, an absolute path). ``lora_int_id`` is the server's to assign (any value
    > 0 here). The server calls it off its event loop, one call per name at a time, and loads
    what it returns as ``/v1/load_lora_adapter`` would; built with ``cls(options=...)``."""

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options

    @abstractmethod
    def resolve(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The adapter ``lora_name`` for the model ``base_model_name`` (the server's ``model``:
        the checkpoint it loaded), or None when this resolver does not know it."""
