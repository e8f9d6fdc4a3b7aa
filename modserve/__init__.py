"""modserve: a plugin-based, modular LLM inference-serving engine."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("modserve")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

from modserve import moved as _moved

_moved.install()  # old module paths keep importing, with a DeprecationWarning

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # Lazy: `import modserve` stays cheap (the CLI and plugin registration import no torch).
    if name == "LLM":
        from modserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from modserve.core.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputs":
        from modserve.core.structured_outputs import StructuredOutputs
        return StructuredOutputs
    if name == "EngineConfig":
        from modserve.core.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
