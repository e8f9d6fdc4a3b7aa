"""Test helpers for modserve and its plugins: deterministic random-weight checkpoints of real
architectures (:mod:`modserve.testing.checkpoints`) and the plugin conformance kit
(:mod:`modserve.testing.conformance`).

Lazy (PEP 562): the kit is a pytest plugin, imported by every pytest run where modserve is
installed, so importing this package must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("modserve.testing.checkpoints"), name)
