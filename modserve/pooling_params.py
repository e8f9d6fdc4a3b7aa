"""``PoolingParams`` where vLLM users import it from (``vllm.pooling_params``): what one
``LLM.embed`` / ``LLM.encode`` call asks of the pooled vectors."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolingParams"]


@dataclass(slots=True)
class PoolingParams:
    """``dimensions``: keep each vector's first N values (Matryoshka models only, else a
    ValueError); ``normalize``: L2-normalize after the cut (None: the model's pooler config)."""

    dimensions: int | None = None
    normalize: bool | None = None
