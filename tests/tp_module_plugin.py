"""A plugin registered as a module (``Registry.add_plugin(tp_module_plugin, ...)``), not
through a distribution, for tests/test_tensor_parallel.py: a tensor-parallel engine must
pass it to its workers (``Registry.sources()``: ``module:tp_module_plugin``), which import it
by name and register it again, since every rank builds the configured sampler.

Its sampler is the built-in default under another name (the tokens must equal the
built-in's) that leaves a file named after its process id in ``$MODSERVE_TP_TEST_MARKERS``
(a ``MODSERVE_`` variable: the driver hands those to its workers) when one is made."""

from __future__ import annotations

import os
from pathlib import Path

from modserve.api import Register, hookimpl
from modserve.samplers.default import DefaultSampler

NAME = "tp_module_sampler"
MARKERS = "MODSERVE_TP_TEST_MARKERS"


class MarkingSampler(DefaultSampler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if folder := os.environ.get(MARKERS):
            (Path(folder) / str(os.getpid())).touch()


@hookimpl
def register_samplers(register: Register) -> None:
    register(NAME, f"{__name__}:MarkingSampler", description="tests: the default sampler, from a module plugin")
