"""Deprecated: the CPU platform's linear method and the platforms' compile mechanism now live in
:mod:`modserve.plugins.platforms` (compile policy and ``decode_weight_dtype``: methods and
functions there); importable here for one minor version."""

import warnings

from modserve.core.linear import float_layers as float_weight_modules  # noqa: F401
from modserve.core.loader import checkpoint_dtype  # noqa: F401
from modserve.plugins.platforms.compile import compile_regions as regions_compiled, compiler  # noqa: F401
from modserve.plugins.platforms.cpu.linear import (  # noqa: F401
    FEW_ROWS, add_decode_weights, linear_or_gemv, load_few_rows_kernel)
from modserve.plugins.platforms.cpu.platform import AUTO_COMPILE_MIN_BYTES  # noqa: F401

warnings.warn("modserve.core.compile moved to modserve.plugins.platforms", DeprecationWarning, stacklevel=2)
