"""Deprecated: moved to :mod:`modserve.plugins.models`; importable here for one minor version."""

import warnings

from modserve.plugins.models import register_model_architectures  # noqa: F401

warnings.warn("modserve.core.models moved to modserve.plugins.models", DeprecationWarning,
              stacklevel=2)
