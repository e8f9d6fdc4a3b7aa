"""Deprecated: moved to :mod:`modserve.plugins.platforms.cpu.host_memory`; importable here for one minor version."""

import warnings

from modserve.plugins.platforms.cpu.host_memory import keep_freed_memory  # noqa: F401

warnings.warn("modserve.core.host_memory moved to modserve.plugins.platforms.cpu.host_memory", DeprecationWarning,
              stacklevel=2)
