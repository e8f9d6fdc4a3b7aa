"""The plugin API: everything a modserve plugin imports, from one module.

A plugin implements a hook (:func:`hookimpl`) that registers its implementations, and
each implementation subclasses the contract of its kind here. What a plugin receives
(``AttentionSpec``, ``AttentionMetadata``, ``SchedulerView``, ``Schedule``, a sequence as
:class:`SequenceView`, ``SamplingBatch``, ...) and the helpers worth reusing (paged-KV
slot arithmetic, the scheduler's budget helpers, sampling and logprob primitives, batch
building, fp8 scaling, C++ kernel builds) are here too. Nothing else under
``modserve.core`` is promised to stay: the engine, runner and scheduler mechanism change
without notice.

Versioned by :data:`PLUGIN_API_VERSION` ("major.minor"): minor releases only add; what a
major release removes was deprecated (a ``DeprecationWarning``, through pluggy's
``warn_on_impl`` for hooks) for at least two minor releases before it. The conformance kit
(:mod:`modserve.testing.conformance`) checks an implementation against its kind's contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from modserve.core.hookspecs import PLUGIN_API_VERSION, Register, hookimpl

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name is imported on first use
    from modserve.api.paged_kv import read_kv, slots, write_kv
    from modserve.api.cpp import load_kernel, op_by_name
    from modserve.api.decoder import DecoderLayerLayout, DecoderLayout
    from modserve.api.fp8 import FP8, FP8_MAX, fp8_to_float, to_fp8
    from modserve.api.scheduling import Budget, admit, advance_running, chunk_size, start_budget
    from modserve.api.sequence import SequenceView
    from modserve.core.batch import build_batch
    from modserve.core.forward_context import attention, forward_context
    from modserve.core.interfaces import (
        AttentionBackend, AttentionMetadata, AttentionSpec, BlockTransfer, CausalLM, CudaGraphSupport, Executor,
        FinishedModel, GrammarBackend, GrammarMatcher, GrammarVocab, GraphSettings, KVAllocator, KVConnector,
        KVConnectorContext, LinearSpec, ModelLoad, MoEBackend,
        Platform, Proposal, Proposer,
        ProposerContext, Quantizer, Sampler, SamplerOutput, SamplingBatch, Schedule, Scheduler,
        SchedulerLimits, SchedulerView, StepForward, TensorLayout, WorkerSpec)
    from modserve.core.linear import (
        Linear, LinearFactory, Unquantized, VocabEmbedding, check_name, float_layers, linear_factory, load_shard,
        model_bytes, param)
    from modserve.core.parallel import TensorParallel
    from modserve.api.worker import run_worker
    from modserve.core.registry import PluginError
    from modserve.core.sampling import add_logprobs, sample_rows
    from modserve.core.sampling_params import SamplingParams
    from modserve.core.sequence import Sequence, SequenceStatus
    from modserve.core.structured_outputs import GrammarSpec, StructuredOutputs

# name -> the module it lives in. Lazy (PEP 562), so a plugin's registration module can
# ``from modserve.api import hookimpl`` without importing torch.
_WHERE: dict[str, str] = {name: module for module, names in (
    ("modserve.api.paged_kv", "read_kv slots write_kv"),
    ("modserve.api.cpp", "load_kernel op_by_name"),
    ("modserve.api.decoder", "DecoderLayerLayout DecoderLayout"),
    ("modserve.api.fp8", "FP8 FP8_MAX fp8_to_float to_fp8"),
    ("modserve.api.scheduling", "Budget admit advance_running chunk_size start_budget"),
    ("modserve.api.sequence", "SequenceView"),
    ("modserve.core.batch", "build_batch"),
    ("modserve.core.forward_context", "attention forward_context"),
    ("modserve.core.interfaces",
     "AttentionBackend AttentionMetadata AttentionSpec BlockTransfer CausalLM CudaGraphSupport Executor "
     "FinishedModel GrammarBackend GrammarMatcher GrammarVocab GraphSettings KVAllocator KVConnector "
     "KVConnectorContext LinearSpec ModelLoad MoEBackend "
     "Platform Proposal Proposer ProposerContext Quantizer Sampler SamplerOutput "
     "SamplingBatch Schedule Scheduler SchedulerLimits SchedulerView StepForward TensorLayout WorkerSpec"),
    ("modserve.core.linear",
     "Linear LinearFactory Unquantized VocabEmbedding check_name float_layers linear_factory "
     "load_shard model_bytes param"),
    ("modserve.core.parallel", "TensorParallel"),
    ("modserve.api.worker", "run_worker"),
    ("modserve.core.registry", "PluginError"),
    ("modserve.core.sampling", "add_logprobs sample_rows"),
    ("modserve.core.sampling_params", "SamplingParams"),
    ("modserve.core.sequence", "Sequence SequenceStatus"),
    ("modserve.core.structured_outputs", "GrammarSpec StructuredOutputs"),
) for name in names.split()}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'modserve.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "PLUGIN_API_VERSION", "PluginError", "Register", "hookimpl",
    # contracts, one per kind
    "AttentionBackend", "CausalLM", "Executor", "GrammarBackend", "GrammarMatcher", "KVAllocator", "MoEBackend",
    "Platform",
    "Proposer", "Quantizer", "Sampler", "Scheduler",
    # the data they receive and return
    "AttentionMetadata", "AttentionSpec", "CudaGraphSupport", "DecoderLayerLayout", "DecoderLayout", "FinishedModel",
    "GrammarSpec", "GrammarVocab",
    "GraphSettings", "LinearSpec", "StepForward",
    "ModelLoad", "Proposal", "ProposerContext", "SamplerOutput", "SamplingBatch", "SamplingParams", "Schedule",
    "SchedulerLimits", "SchedulerView", "Sequence", "SequenceStatus", "SequenceView", "StructuredOutputs",
    "TensorLayout", "WorkerSpec",
    # models and linears
    "Linear", "LinearFactory", "TensorParallel", "Unquantized", "VocabEmbedding", "attention", "check_name", "float_layers", "forward_context",
    "linear_factory", "load_shard", "model_bytes", "param",
    # helpers
    "Budget", "FP8", "FP8_MAX", "add_logprobs", "admit", "advance_running", "build_batch", "chunk_size",
    "fp8_to_float", "load_kernel", "op_by_name", "read_kv", "run_worker", "sample_rows", "slots", "start_budget", "to_fp8", "write_kv",
]
