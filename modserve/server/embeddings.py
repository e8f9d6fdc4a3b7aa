"""POST /v1/embeddings (the pooling runner): inputs in, one vector each out, in OpenAI's shape."""

from __future__ import annotations

import base64

import torch

from fastapi import FastAPI

from modserve.engine.client import EngineClient
from modserve.engine.engine import NOT_POOLING
from modserve.server.errors import APIError, invalid
from modserve.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from modserve.server.serving import ServerState, new_id

POOLING_ONLY = ("this model is served with the pooling runner (--runner pooling): it answers /v1/embeddings, "
                "not {}")


class Embedder:
    """The pooling engine's ``embed``, run between its steps wherever it runs.
    NOTE: a pooling engine never gets a generate request, so its steps never run the model:
    these calls are the only ones that do."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    async def embed(self, prompts: list[list[int]], dimensions: int | None) -> list[torch.Tensor]:
        return await self.engine.call_utility("embed", prompts, None, dimensions)


def add_embedding_routes(app: FastAPI, state: ServerState, engine: EngineClient) -> None:
    config = engine.config
    app.state.embedder = Embedder(engine) if config.runner == "pooling" else None

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        return await create_embedding(body, state, app.state.embedder, config.max_embedding_inputs)


def refuse_generate(app: FastAPI, route: str) -> None:
    """A 400 for completions and chat on a pooling runner, as vLLM answers."""
    if app.state.embedder is not None:
        raise APIError(400, POOLING_ONLY.format(route), code="model_not_supported")


async def create_embedding(body: EmbeddingRequest, state: ServerState, embedder: Embedder | None,
                           max_inputs: int) -> EmbeddingResponse:
    if state.check_model(body.model) is not None:  # the pooling runner has no adapter rows
        raise invalid("model", f"{body.model!r} is a LoRA adapter: embeddings run on the base model only")
    if embedder is None:
        raise APIError(400, NOT_POOLING, code="model_not_supported")
    texts = body.inputs()
    if len(texts) > max_inputs:
        raise invalid("input", f"holds {len(texts)} inputs, over max_embedding_inputs={max_inputs}")
    prompts = [await state.encode(t, "input", body.add_special_tokens) if isinstance(t, str) else list(t)
               for t in texts]
    for ids in prompts:
        state.check_prompt(ids, "input")  # the same length and vocabulary 400s as completions
    try:
        vectors = await embedder.embed(prompts, body.dimensions)
    except ValueError as e:  # dimensions this model does not support
        raise invalid("dimensions", str(e)) from None
    data = [EmbeddingData(index=i, embedding=_encoded(v, body.encoding_format)) for i, v in enumerate(vectors)]
    tokens = sum(map(len, prompts))
    return EmbeddingResponse(id=new_id("embd"), model=state.model_name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 bytes, little-endian
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
