"""Deprecated: moved to :mod:`modserve.plugins.platforms.cpu.prepack`; importable here for one minor version."""

import warnings

from modserve.plugins.platforms.cpu.prepack import PANEL, add_packed_weights, packed_linear, to_panels  # noqa: F401

warnings.warn("modserve.core.prepack moved to modserve.plugins.platforms.cpu.prepack", DeprecationWarning,
              stacklevel=2)
