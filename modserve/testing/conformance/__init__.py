"""The conformance kit: the contract of each plugin kind as tests, run against any implementation.

A plugin author checks an implementation after installing the distribution that registers it
(its ``modserve`` entry point), or with ``MODSERVE_LOAD_PLUGINS`` naming that distribution::

    pytest --pyargs modserve.testing.conformance --modserve-conformance attention_backend:myattn

``--modserve-conformance KIND:NAME`` is repeatable; the kit's tests of kinds not named are
deselected. Without it, every implementation the registry knows is checked (the built-ins
included). An implementation that needs options gets them as JSON::

    --modserve-conformance-options 'proposer:mydraft={"model": "/ckpt/draft"}'

One module per kind (``test_<kind>.py``): attention_backend, kv_allocator, scheduler,
sampler, grammar_backend, quantizer (its tensor-parallel shards too), proposer, executor
(engines of two ranks on the tiny Llama: seconds each), kv_connector, tool_parser,
reasoning_parser, logits_processor. Each test says in its docstring which part of
the contract (:mod:`modserve.core.contracts`) it checks, and its assertion messages say what
the contract requires and what the implementation did. Checks that need a capability an
implementation may lack (an fp8 KV cache, ``fork``, ``Sampler.probs``) are skipped, with the
reason, where it says it lacks it.

The pytest plugin (:mod:`modserve.testing.conformance.plugin`) is registered as the
``pytest11`` entry point ``modserve``; with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set, add
``-p modserve.testing.conformance.plugin``. From Python, :func:`run` does the same as the
command above.
"""

from __future__ import annotations

import os
from typing import Sequence

PACKAGE = "modserve.testing.conformance"


def run(targets: list[str], extra_args: Sequence[str] = ()) -> int:
    """Run the kit on ``targets`` (``KIND:NAME`` each; empty: everything registered) in this
    process, with ``extra_args`` passed on to pytest. Returns pytest's exit code (0: all passed)."""
    import pytest
    import torch

    if not torch.cuda.is_available():  # Triton kernels (a triton backend) then run in its interpreter, slowly
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args = ["--pyargs", PACKAGE]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):  # else the entry point loads it
        args += ["-p", f"{PACKAGE}.plugin"]
    for target in targets:
        args += ["--modserve-conformance", target]
    return int(pytest.main([*args, *extra_args]))
