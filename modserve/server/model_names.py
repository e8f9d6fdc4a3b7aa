"""The names the server answers to. With no ``--served-model-name``, the checkpoint
directory's base name (``/models/qwen2.5-0.5b`` -> ``qwen2.5-0.5b``; a Hugging Face cache
snapshot -> ``ORG/NAME``): the local path is never shown, yet a vLLM-style client that
sends the ``--model`` string as the model still matches."""

from __future__ import annotations

from pathlib import PurePath

from modserve.core.config import EngineConfig

HF_CACHE_PREFIX = "models--"  # huggingface_hub's cache: models--ORG--NAME/snapshots/REVISION


def served_names(config: EngineConfig) -> tuple[list[str], tuple[str, ...]]:
    """(the names listed on /v1/models, the first reported; names accepted but never listed)."""
    if config.served_model_name is not None:
        return config.served_model_names(), ()
    return [default_served_name(config.model)], (config.model,)


def default_served_name(model: str) -> str:
    path = PurePath(model)
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith(HF_CACHE_PREFIX):
        return repo[len(HF_CACHE_PREFIX):].replace("--", "/")
    return path.name or model
