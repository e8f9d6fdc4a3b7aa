"""Module paths that moved, kept importable with a DeprecationWarning for one minor version.

One import hook instead of a shim file per old path: the old modules hold no code, and
``modserve/core`` holds only the core. Each old path re-exports the names it had.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

_PLATFORMS = "modserve.plugins.platforms"
_CPU = f"{_PLATFORMS}.cpu"
_CONTRACTS = "modserve.core.contracts"

# old path -> (where it went, {name it exported: "new.module:name"})
MOVED: dict[str, tuple[str, dict[str, str]]] = {
    "modserve.core.models": ("modserve.plugins.models", {
        "register_model_architectures": "modserve.plugins.models:register_model_architectures"}),
    "modserve.core.models.llama": ("modserve.plugins.models.llama", {
        n: f"modserve.plugins.models.llama:{n}" for n in (
            "MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding",
            "rope_inv_freq")}),
    "modserve.core.compile": (_PLATFORMS, {
        "float_weight_modules": "modserve.runner.linear:float_layers",
        "checkpoint_dtype": "modserve.runner.loader:checkpoint_dtype",
        "regions_compiled": f"{_PLATFORMS}.compile:compile_regions",
        "compiler": f"{_PLATFORMS}.compile:compiler",
        **{n: f"{_CPU}.linear:{n}" for n in ("FEW_ROWS", "add_decode_weights", "linear_or_gemv",
                                             "load_few_rows_kernel")},
        "AUTO_COMPILE_MIN_BYTES": f"{_CPU}.platform:AUTO_COMPILE_MIN_BYTES"}),
    "modserve.core.prepack": (f"{_CPU}.prepack", {
        n: f"{_CPU}.prepack:{n}" for n in ("PANEL", "add_packed_weights", "packed_linear", "to_panels")}),
    "modserve.core.cpu_kernels": (f"{_CPU}.kernels", {
        n: f"{_CPU}.kernels:{n}" for n in ("bf16_linear_ready", "load_kernel")}),
    "modserve.core.host_memory": (f"{_CPU}.host_memory", {
        "keep_freed_memory": f"{_CPU}.host_memory:keep_freed_memory"}),
    "modserve.core.fp8": ("modserve.api.fp8", {
        n: f"modserve.api.fp8:{n}" for n in ("FP8", "FP8_MAX", "fp8_to_float", "to_fp8")}),
    "modserve.quantizers.e4m3": ("modserve.api.fp8", {
        n: f"modserve.api.fp8:{n}" for n in ("FP8", "FP8_MAX", "fp8_to_float", "to_fp8")}),
    "modserve.core.llm": ("modserve.llm", {"LLM": "modserve.llm:LLM"}),
    "modserve.plugins.schedulers.base": ("modserve.api", {
        n: f"modserve.api.scheduling:{n}" for n in ("Budget", "admit", "advance_running", "chunk_size",
                                                     "start_budget")}),
    # The core split into core (contracts), engine (rank 0) and runner (every rank): the modules
    # whose names modserve.api re-exported.
    "modserve.core.interfaces": (_CONTRACTS, {n: f"{_CONTRACTS}.{m}:{n}" for m, names in (
        ("attention_backend", "AttentionBackend AttentionMetadata AttentionSpec CudaGraphSupport"),
        ("executor", "Executor WorkerSpec"),
        ("grammar_backend", "GrammarBackend GrammarMatcher GrammarVocab"),
        ("kv_allocator", "KVAllocator"),
        ("kv_connector", "BlockTransfer KVConnector KVConnectorContext KVRole"),
        ("model", "CausalLM"),
        ("moe_backend", "MoEBackend"),
        ("platform", "FinishedModel GraphSettings ModelLoad Platform StepForward"),
        ("proposer", "Proposal Proposer ProposerContext"),
        ("quantizer", "LinearSpec Quantizer TensorLayout"),
        ("sampler", "Sampler SamplerOutput SamplingBatch"),
        ("scheduler", "Schedule Scheduler SchedulerLimits SchedulerView"),
    ) for n in names.split()}),
    "modserve.api.decoder": (f"{_CONTRACTS}.model", {
        n: f"{_CONTRACTS}.model:{n}" for n in ("DecoderLayerLayout", "DecoderLayout")}),
    "modserve.api.worker": ("modserve.runner.main", {"run_worker": "modserve.runner.main:run_worker"}),
    "modserve.core.batch": ("modserve.runner.batch", {"build_batch": "modserve.runner.batch:build_batch"}),
    "modserve.core.forward_context": ("modserve.runner.forward_context", {
        n: f"modserve.runner.forward_context:{n}" for n in ("attention", "forward_context")}),
    "modserve.core.linear": ("modserve.runner.linear", {n: f"modserve.runner.linear:{n}" for n in (
        "Linear", "LinearFactory", "Unquantized", "VocabEmbedding", "check_name", "float_layers",
        "linear_factory", "load_shard", "model_bytes", "param")}),
    "modserve.core.parallel": ("modserve.runner.parallel", {"TensorParallel": "modserve.runner.parallel:TensorParallel"}),
    "modserve.core.sampling": ("modserve.runner.sampling", {
        n: f"modserve.runner.sampling:{n}" for n in ("add_logprobs", "sample_rows")}),
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        is_package = any(other.startswith(fullname + ".") for other in MOVED)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        where, names = MOVED[module.__name__]
        module.__doc__ = f"Deprecated: moved to {where}; importable here for one minor version."
        for name, target in names.items():
            source, _, attr = target.partition(":")
            setattr(module, name, getattr(importlib.import_module(source), attr))
        warnings.warn(f"{module.__name__} moved to {where}", DeprecationWarning, stacklevel=2)


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
