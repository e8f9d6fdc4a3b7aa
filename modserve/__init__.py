"""modserve: a plugin-based, modular LLM inference-serving engine."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("modserve")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

from modserve import moved as _moved

_moved.install()  # old module paths keep importing, with a DeprecationWarning

# name -> the module that defines it; vLLM's top-level names among them
_EXPORTS = {
    "LLM": "modserve.llm",
    "SamplingParams": "modserve.core.sampling_params",
    "LoRARequest": "modserve.core.lora_request",
    "BeamSearchParams": "modserve.beam_search",
    "StructuredOutputs": "modserve.core.structured_outputs",
    "EngineConfig": "modserve.core.config",
    "TextPrompt": "modserve.inputs",
    "TokensPrompt": "modserve.inputs",
    "RequestOutput": "modserve.core.outputs",
    "CompletionOutput": "modserve.core.outputs",
    "PoolingParams": "modserve.pooling_params",
    "EmbeddingRequestOutput": "modserve.outputs",
    "PoolingRequestOutput": "modserve.outputs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    # Lazy: `import modserve` stays cheap (the CLI and plugin registration import no torch).
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
