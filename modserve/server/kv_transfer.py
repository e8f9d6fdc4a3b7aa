"""vLLM's ``kv_transfer_params`` in completions and chat requests: how a disaggregation proxy
(vLLM's toy proxy, a gateway's sidecar) pairs a prefill server with a decode server.

The proxy sends the prefill server ``{"do_remote_decode": true}``; its answer carries the
params the proxy puts in the decode request (``do_remote_prefill``, where the producer is),
and the decode server's KV connector pulls the prompt's blocks from there.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from modserve.core.sampling_params import SamplingParams
from modserve.server.errors import invalid

FIELD = "kv_transfer_params"
Name = Annotated[str, Field(max_length=256)]


class KVTransferParams(BaseModel):
    """The keys vLLM's NIXL and Mooncake connectors put there (others: a 400 naming them)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # protocol.py's Strict (which imports this)

    do_remote_decode: bool = False  # prefill request: keep the prompt's KV for a decode server
    do_remote_prefill: bool = False  # decode request: load the prompt's KV from the producer named
    remote_bootstrap_addr: str | None = Field(None, max_length=300, pattern=r"^(http://)?[^\s:/]+:\d{1,5}/?$")
    remote_host: str | None = Field(None, max_length=255, pattern=r"^[^\s:/]+$")
    remote_port: int | None = Field(None, ge=1, le=65535)
    remote_engine_id: Name | None = None
    remote_request_id: Name | None = None
    transfer_id: Name | None = None
    tp_size: int | None = Field(None, ge=1, le=4096)
    # NIXL's; accepted and unused: modserve's consumer finds the blocks by their content
    # (bounded, as the whole body, by max_request_body_bytes)
    remote_block_ids: list[int] | list[list[int]] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> KVTransferParams:
        if self.do_remote_decode and self.do_remote_prefill:
            raise invalid(f"{FIELD}.do_remote_prefill", "cannot be true with do_remote_decode: a request is "
                          "either the prefill or the decode half")
        if self.remote_bootstrap_addr and not 0 < int(self.remote_bootstrap_addr.rstrip("/").rsplit(":", 1)[1]) < 65536:
            raise invalid(f"{FIELD}.remote_bootstrap_addr", "has a port outside 1-65535")
        if self.do_remote_prefill and not (self.remote_bootstrap_addr or (self.remote_host and self.remote_port)):
            raise invalid(f"{FIELD}.do_remote_prefill", "needs the producer's address: remote_bootstrap_addr "
                          "(host:port), or remote_host and remote_port")
        return self


async def kv_transfer(body: Any, state: Any, params: SamplingParams, response_id: str) -> dict[str, Any] | None:
    """Check a request's ``kv_transfer_params`` against this server's connector, hand a decode
    request's to the engine (``params.extra_args``, as vLLM), and return what a prefill
    request's answer carries (None: nothing)."""
    kv: KVTransferParams | None = body.kv_transfer_params
    if kv is None or not (kv.do_remote_decode or kv.do_remote_prefill):
        return None
    config = state.engine.config
    if kv.do_remote_prefill:
        if config.kv_connector is None or config.kv_role == "producer":
            raise invalid(f"{FIELD}.do_remote_prefill", "this server has no KV connector that loads (kv_connector "
                          "with kv_role consumer or both)")
        params.extra_args = {**(params.extra_args or {}), FIELD: kv.model_dump(exclude_none=True)}
        return None
    if body.stream:
        raise invalid(f"{FIELD}.do_remote_decode", "needs stream false: the answer carries where the KV is")
    if config.kv_connector is None or config.kv_role == "consumer":
        raise invalid(f"{FIELD}.do_remote_decode", "this server has no KV connector that saves for a decode "
                      "server (kv_connector with kv_role producer or both)")
    answer = await state.engine.call_utility("kv_transfer_params")
    # None: a store the consumer finds by content alone (shared_storage, shm) needs no params
    return None if answer is None else {**answer, "remote_request_id": response_id}
