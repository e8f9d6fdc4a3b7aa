"""Deprecated: moved to :mod:`modserve.plugins.platforms.cpu.kernels`; importable here for one minor version."""

import warnings

from modserve.plugins.platforms.cpu.kernels import bf16_linear_ready, load_kernel  # noqa: F401

warnings.warn("modserve.core.cpu_kernels moved to modserve.plugins.platforms.cpu.kernels", DeprecationWarning,
              stacklevel=2)
