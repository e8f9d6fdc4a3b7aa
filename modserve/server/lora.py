"""LoRA adapters by name at the server: ``--lora-modules`` at start, ``model: <adapter>`` in a request,
``/v1/models`` cards with ``parent``, and vLLM's run-time ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, vLLM's gate)."""

from __future__ import annotations

import itertools
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from modserve.core.lora_request import LoRARequest
from modserve.server.errors import APIError, invalid
from modserve.server.protocol import ModelCard
from modserve.server.serving import ServerState

RUNTIME_UPDATES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES, "").lower() in ("1", "true")


async def load_lora_modules(state: ServerState) -> None:
    """The adapters of ``lora_modules``, checked and cached by the engine before the server takes requests."""
    for module in state.engine.config.lora_modules:
        await add_adapter(state, module.name, module.path, module.base_model_name)


async def add_adapter(state: ServerState, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
    """Adapter ``name`` checked and cached by the engine, then served (a 400 naming what is wrong)."""
    if name == state.model_name or name in state.model_aliases:
        raise invalid("lora_name", f"{name!r} is the base model's name")
    ids = itertools.count(1)  # the lowest id no adapter holds: ids stay small as adapters come and go
    taken = {lora.lora_int_id for lora in state.loras.values()}
    request = LoRARequest(name, next(i for i in ids if i not in taken), path, base_model_name)
    try:
        await state.engine.call_utility("add_lora", request)
    except ValueError as e:
        raise invalid("lora_path", str(e)) from None
    state.loras[name] = request
    return request


def lora_cards(state: ServerState) -> list[ModelCard]:
    """One card per adapter: its name, the base model as ``parent``."""
    return [ModelCard(id=name, root=name, parent=state.model_name, max_model_len=state.max_model_len)
            for name in state.loras]


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's run-time adapter routes, where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` allows them."""
    if not (state.engine.config.enable_lora and runtime_updates_allowed()):
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name in state.loras and not body.load_inplace:
            raise invalid("lora_name", f"the LoRA adapter '{body.lora_name}' has already been loaded")
        old = state.loras.pop(body.lora_name, None)
        if old is not None:  # load_inplace: the new weights under the same name
            await state.engine.call_utility("remove_lora", old.lora_int_id)
        await add_adapter(state, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        lora = state.loras.pop(body.lora_name, None)
        if lora is None:
            raise APIError(404, f"The LoRA adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="lora_adapter_not_found")
        await state.engine.call_utility("remove_lora", lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
