"""Deprecated: moved to :mod:`modserve.quantizers.e4m3`; importable here for one minor version."""

import warnings

from modserve.quantizers.e4m3 import FP8, FP8_MAX, fp8_to_float, to_fp8  # noqa: F401

warnings.warn("modserve.core.fp8 moved to modserve.quantizers.e4m3", DeprecationWarning,
              stacklevel=2)
