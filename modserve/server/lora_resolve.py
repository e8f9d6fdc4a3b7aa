"""Adapters found when a request names them (vLLM's LoRA resolvers): a ``model`` that is neither the
base model nor a loaded adapter is looked up by the ``lora_resolvers`` plugins, in order; the first
adapter found that loads is added as ``/v1/load_lora_adapter`` adds one, and the request runs under it."""

from __future__ import annotations

import asyncio
import logging
import os

from modserve.core.config import EngineConfig, PluginChoice
from modserve.core.contracts.lora_resolver import LoRAResolver
from modserve.core.registry import PluginError, get_registry, registration_of
from modserve.server.errors import APIError, invalid
from modserve.server.lora import RUNTIME_UPDATES, add_adapter, runtime_updates_allowed
from modserve.server.serving import ServerState

logger = logging.getLogger("modserve")

CACHE_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"  # vLLM's: alone, it turns the filesystem resolver on


class AdapterResolution:
    """The server's resolvers, and the lookups in flight: one per name, shared by every request
    that names it meanwhile (so an adapter is loaded once), gone when it ends."""

    def __init__(self, state: ServerState, resolvers: list[LoRAResolver]) -> None:
        self.state, self.resolvers = state, resolvers
        self.pending: dict[str, asyncio.Future[None]] = {}

    async def __call__(self, name: str) -> None:
        """Load adapter ``name`` if a resolver finds it; a 400 naming why when every one found refused it."""
        task = self.pending.get(name)
        if task is None:
            task = self.pending[name] = asyncio.ensure_future(self._resolve(name))
            task.add_done_callback(lambda _: self.pending.pop(name, None))
        await asyncio.shield(task)  # NOTE: a client that goes away does not cancel the others' load

    async def _resolve(self, name: str) -> None:
        state, refusals = self.state, []
        for resolver in self.resolvers:
            timeout = state.engine.config.lora_resolver_timeout
            try:
                # NOTE: past the timeout the thread still runs; its answer, if any, is dropped
                found = await asyncio.wait_for(asyncio.to_thread(resolver.resolve, state.engine.config.model, name),
                                               timeout)
            except ValueError as e:  # it knows the name and refuses it
                refusals.append(str(e))
                continue
            except TimeoutError:
                logger.warning("%s took over %s s resolving %r", _named(resolver), timeout, name)
                raise APIError(503, f"looking up the LoRA adapter {name!r} took over lora_resolver_timeout="
                               f"{timeout} s ({_named(resolver)})", type="server_error", param="model",
                               code="lora_resolver_timeout") from None
            except Exception as e:
                raise PluginError(f"{_named(resolver)} failed resolving {name!r}: {type(e).__name__}: {e}") from e
            if name in state.loras:  # loaded meanwhile through /v1/load_lora_adapter
                return
            if found is None:
                continue
            if found.lora_name != name:
                raise PluginError(f"{_named(resolver)} resolved {name!r} to an adapter named {found.lora_name!r}")
            try:
                await add_adapter(state, name, found.lora_path, found.base_model_name)
            except APIError as e:  # found, but the engine cannot use it: the next resolver may do better
                refusals.append(e.message)
                continue
            logger.info("LoRA adapter %r resolved by %s: %s", name, _named(resolver), found.lora_path)
            return
        if refusals:
            raise invalid("model", f"the LoRA adapter {name!r} was found but cannot be served: "
                          + "; ".join(refusals))


def _named(resolver: LoRAResolver) -> str:
    reg = registration_of(resolver)
    return f"lora_resolver {reg.name!r} from {reg.origin}" if reg is not None else type(resolver).__name__


def lora_resolution(state: ServerState, config: EngineConfig) -> AdapterResolution | None:
    """The configured resolvers, built (bad names and options fail the start), or None when none
    applies. ``VLLM_LORA_RESOLVER_CACHE_DIR`` alone selects ``filesystem``, as it does in vLLM."""
    choices = list(config.lora_resolvers)
    from_env = not choices and bool(os.environ.get(CACHE_DIR_ENV))
    if from_env:
        choices = [PluginChoice(name="filesystem")]
    if not choices or not config.enable_lora:
        return None
    if not runtime_updates_allowed():
        if from_env:  # vLLM ignores it too: said, not silent
            logger.warning("%s is set, but adapters are resolved only with %s=True", CACHE_DIR_ENV, RUNTIME_UPDATES)
            return None
        raise ValueError(f"lora_resolvers load adapters while the server runs: set {RUNTIME_UPDATES}=True "
                         "(vLLM's gate), or drop lora_resolvers")
    registry = get_registry()
    return AdapterResolution(state, [registry.create("lora_resolver", choice) for choice in choices])
