"""``LoRARequest``: which adapter a request runs under (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) by name.

    ``lora_int_id`` (> 0) identifies the adapter everywhere (its slot, its prefix-cache keys):
    two requests with the same id share its weights and KV; ``lora_name`` is what the server
    lists and requests name as their ``model``."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, not {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} names no lora_path")

    @property
    def cache_salt(self) -> bytes:
        """What keys this adapter's prefix-cache blocks apart from the base model's and others'."""
        return f"lora:{self.lora_int_id}:{self.lora_name}".encode()
