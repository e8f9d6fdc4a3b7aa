"""The plugin API: everything a modserve plugin imports, from one module.

A plugin implements a hook (:func:`hookimpl`) that registers its implementations, and
each implementation subclasses the contract of its kind here. What a plugin receives
(``AttentionSpec``, ``AttentionMetadata``, ``SchedulerView``, ``Schedule``, a sequence as
:class:`SequenceView`, ``SamplingBatch``, ...) and the helpers worth reusing (paged-KV
slot arithmetic, the scheduler's budget helpers, sampling and logprob primitives, batch
building, fp8 scaling, C++ kernel builds) are here too. Nothing else under
``modserve.core``, ``modserve.engine`` or ``modserve.runner`` is promised to stay: the engine, runner and scheduler mechanism change
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
    from modserve.api.fp8 import FP8, FP8_MAX, fp8_to_float, to_fp8
    from modserve.api.scheduling import Budget, admit, advance_running, chunk_size, start_budget
    from modserve.api.sequence import SequenceView
    from modserve.runner.batch import build_batch
    from modserve.runner.forward_context import attention, forward_context
    from modserve.core.contracts.attention_backend import (
        AttentionBackend, AttentionMetadata, AttentionSpec, CudaGraphSupport)
    from modserve.core.contracts.kv_connector import BlockTransfer, KVConnector, KVConnectorContext
    from modserve.core.contracts.model import CausalLM, DecoderLayerLayout, DecoderLayout
    from modserve.core.contracts.lora import LoRAKernel, LoRAMapping
    from modserve.core.contracts.executor import Executor, WorkerSpec
    from modserve.core.contracts.platform import FinishedModel, GraphSettings, ModelLoad, Platform, StepForward
    from modserve.core.contracts.grammar_backend import GrammarBackend, GrammarMatcher, GrammarVocab
    from modserve.core.contracts.kv_allocator import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVAllocator, KVCacheEvent, block_keys)
    from modserve.core.contracts.quantizer import LinearSpec, Quantizer, TensorLayout
    from modserve.core.contracts.moe_backend import MoEBackend
    from modserve.core.contracts.proposer import Proposal, Proposer, ProposerContext
    from modserve.core.contracts.sampler import Sampler, SamplerOutput, SamplingBatch
    from modserve.core.contracts.scheduler import Schedule, Scheduler, SchedulerLimits, SchedulerView
    from modserve.core.contracts.tool_parser import ToolCall, ToolCallDelta, ToolExtraction, ToolParser, ToolStreamDelta
    from modserve.core.contracts.reasoning_parser import ReasoningDelta, ReasoningParser
    from modserve.core.contracts.lora_resolver import LoRAResolver
    from modserve.core.lora_request import LoRARequest
    from modserve.core.contracts.logits_processor import (
        AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality, extra_arg)
    from modserve.api.tool_parsing import PartialCall, ReparsingToolParser, hold_back, json_call, json_objects
    from modserve.runner.linear import (
        Linear, LinearFactory, Unquantized, VocabEmbedding, check_name, float_layers, linear_factory, load_shard,
        model_bytes, param)
    from modserve.runner.parallel import TensorParallel
    from modserve.runner.checkpoint import CheckpointTensor, as_tensor
    from modserve.runner.main import run_worker
    from modserve.core.registry import PluginError
    from modserve.runner.sampling import add_logprobs, sample_rows
    from modserve.runner.logits_processors import apply_processors
    from modserve.core.sampling_params import SamplingParams
    from modserve.core.sequence import Sequence, SequenceStatus
    from modserve.core.structured_outputs import GrammarSpec, StructuredOutputs

# name -> the module it lives in. Lazy (PEP 562), so a plugin's registration module can
# ``from modserve.api import hookimpl`` without importing torch.
_WHERE: dict[str, str] = {name: module for module, names in (
    ("modserve.api.paged_kv", "read_kv slots write_kv"),
    ("modserve.api.cpp", "load_kernel op_by_name"),
    ("modserve.api.fp8", "FP8 FP8_MAX fp8_to_float to_fp8"),
    ("modserve.api.scheduling", "Budget admit advance_running chunk_size start_budget"),
    ("modserve.api.sequence", "SequenceView"),
    ("modserve.runner.batch", "build_batch"),
    ("modserve.runner.forward_context", "attention forward_context"),
    ("modserve.core.contracts.attention_backend", "AttentionBackend AttentionMetadata AttentionSpec CudaGraphSupport"),
    ("modserve.core.contracts.executor", "Executor WorkerSpec"),
    ("modserve.core.contracts.grammar_backend", "GrammarBackend GrammarMatcher GrammarVocab"),
    ("modserve.core.contracts.kv_allocator",
     "AllBlocksCleared BlockRemoved BlockStored KVAllocator KVCacheEvent block_keys"),
    ("modserve.core.contracts.kv_connector", "BlockTransfer KVConnector KVConnectorContext"),
    ("modserve.core.contracts.model", "CausalLM DecoderLayerLayout DecoderLayout"),
    ("modserve.core.contracts.lora", "LoRAKernel LoRAMapping"),
    ("modserve.core.contracts.moe_backend", "MoEBackend"),
    ("modserve.core.contracts.platform", "FinishedModel GraphSettings ModelLoad Platform StepForward"),
    ("modserve.core.contracts.proposer", "Proposal Proposer ProposerContext"),
    ("modserve.core.contracts.quantizer", "LinearSpec Quantizer TensorLayout"),
    ("modserve.core.contracts.sampler", "Sampler SamplerOutput SamplingBatch"),
    ("modserve.core.contracts.scheduler", "Schedule Scheduler SchedulerLimits SchedulerView"),
    ("modserve.core.contracts.tool_parser", "ToolCall ToolCallDelta ToolExtraction ToolParser ToolStreamDelta"),
    ("modserve.core.contracts.reasoning_parser", "ReasoningDelta ReasoningParser"),
    ("modserve.core.contracts.lora_resolver", "LoRAResolver"),
    ("modserve.core.lora_request", "LoRARequest"),
    ("modserve.core.contracts.logits_processor", "AddedRequest BatchUpdate LogitsProcessor MoveDirectionality extra_arg"),
    ("modserve.api.tool_parsing", "PartialCall ReparsingToolParser hold_back json_call json_objects value_end"),
    ("modserve.runner.linear",
     "Linear LinearFactory Unquantized VocabEmbedding check_name float_layers linear_factory "
     "load_shard model_bytes param"),
    ("modserve.runner.parallel", "TensorParallel"),
    ("modserve.runner.checkpoint", "CheckpointTensor as_tensor"),
    ("modserve.runner.main", "run_worker"),
    ("modserve.core.registry", "PluginError"),
    ("modserve.runner.sampling", "add_logprobs sample_rows"),
    ("modserve.runner.logits_processors", "apply_processors"),
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
    "Proposer", "Quantizer", "ReasoningParser", "Sampler", "Scheduler", "ToolParser", "LogitsProcessor",
    "LoRAResolver",
    # the data they receive and return
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent",
    "AttentionMetadata", "AttentionSpec", "CudaGraphSupport", "DecoderLayerLayout", "DecoderLayout", "FinishedModel",
    "GrammarSpec", "GrammarVocab",
    "GraphSettings", "LinearSpec", "StepForward", "LoRAKernel", "LoRAMapping",
    "ModelLoad", "Proposal", "ProposerContext", "SamplerOutput", "SamplingBatch", "SamplingParams", "Schedule",
    "SchedulerLimits", "SchedulerView", "Sequence", "SequenceStatus", "SequenceView", "StructuredOutputs",
    "TensorLayout", "WorkerSpec", "ReasoningDelta", "ToolCall", "ToolCallDelta", "ToolExtraction", "ToolStreamDelta",
    "AddedRequest", "BatchUpdate", "MoveDirectionality", "extra_arg", "LoRARequest",
    # helpers for tool parsers (modserve/api/tool_parsing.py)
    "PartialCall", "ReparsingToolParser", "hold_back", "json_call", "json_objects", "value_end",
    # models and linears
    "Linear", "LinearFactory", "TensorParallel", "Unquantized", "VocabEmbedding", "attention", "check_name", "float_layers", "forward_context",
    "linear_factory", "load_shard", "model_bytes", "param", "CheckpointTensor", "as_tensor",
    # helpers
    "Budget", "FP8", "FP8_MAX", "add_logprobs", "admit", "apply_processors", "advance_running", "block_keys", "build_batch", "chunk_size",
    "fp8_to_float", "load_kernel", "op_by_name", "read_kv", "run_worker", "sample_rows", "slots", "start_budget", "to_fp8", "write_kv",
]
