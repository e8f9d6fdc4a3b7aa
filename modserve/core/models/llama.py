"""Deprecated: moved to :mod:`modserve.plugins.models.llama`; importable here for one minor version."""

import warnings

from modserve.plugins.models.llama import (  # noqa: F401
    MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm, RotaryEmbedding, rope_inv_freq)

warnings.warn("modserve.core.models.llama moved to modserve.plugins.models.llama", DeprecationWarning,
              stacklevel=2)
