"""Shared fixtures: random-weight checkpoints, engine factories, and the KV-leak guard."""

from __future__ import annotations

import os
import weakref

# Only modserve's own built-ins auto-load under test: what else is installed must not matter.
os.environ["MODSERVE_LOAD_PLUGINS"] = "modserve"

import pytest
import torch

# Triton kernels (attention_backend: triton, the AWQ GEMM) run on CPU tensors only in Triton's
# interpreter, which triton.jit picks when a kernel is defined: so before any test imports one.
# Where a GPU runs them for real, the kernels are compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from modserve.engine import engine as engine_mod
from modserve.core.registry import reset_registry
from modserve.testing import cached_checkpoint

_live_engines: "weakref.WeakSet[engine_mod.LLMEngine]" = weakref.WeakSet()
_original_init = engine_mod.LLMEngine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _live_engines.add(self)


engine_mod.LLMEngine.__init__ = _tracking_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def all_kv_blocks_free_after_test():
    """After every test, every engine still alive has no request left and all its blocks free."""
    yield
    for eng in list(_live_engines):
        assert not eng.requests, f"requests left in the engine: {list(eng.requests)}"
        assert not eng.scheduler.has_work(), "sequences left in the scheduler queues"
        free = eng.allocator.num_free_blocks()
        total = eng.allocator.num_blocks
        assert free == total, f"KV blocks leaked: {total - free} of {total} in use"


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    root = os.environ.get("MODSERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("checkpoints"))

    def make(arch: str = "llama", **overrides) -> str:
        return str(cached_checkpoint(arch, cache_dir=root, **overrides))

    return make


@pytest.fixture(scope="session")
def llama_dir(checkpoint_dir) -> str:
    return checkpoint_dir("llama")


@pytest.fixture(scope="session")
def qwen_dir(checkpoint_dir, tmp_path_factory) -> str:
    """The tiny Qwen2 with Qwen2.5's chat template (tool calls, <tool_call> and <think> tests)."""
    from modserve.testing.chat_templates import QWEN25_TEMPLATE, with_chat_template

    return str(with_chat_template(checkpoint_dir("qwen2"), tmp_path_factory.mktemp("qwen25"), QWEN25_TEMPLATE))
