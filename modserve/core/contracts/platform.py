"""The platform's contract (config key ``platform``): one device type's answers (:class:`Platform`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple

import torch
from pydantic import BaseModel

from modserve.core.contracts.attention_backend import AttentionBackend, AttentionMetadata
from modserve.core.contracts.model import CausalLM
from modserve.core.contracts.lora import LoRAKernel
from modserve.core.contracts.quantizer import Quantizer


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """A model whose weights are loaded, as :meth:`Platform.finish_model` sees it."""

    compile: str  # the compile setting: auto, on, off
    dtype_setting: str  # the dtype setting: auto or a dtype's name
    prepack_weights: str  # auto, on, off
    dtype: torch.dtype  # the compute dtype
    checkpoint_dtype: torch.dtype  # the checkpoint's own
    quantized: bool  # a quantizer owns the projections' weights (never the LM head's)
    quantizer_traceable: bool = False  # its apply traces under torch.compile (Quantizer.traceable)


class FinishedModel(NamedTuple):
    """What :meth:`Platform.finish_model` did."""

    compiled: bool  # its regions run compiled: the engine warms them up before serving
    decode_weight_bytes: int | None = None  # what batch-1 decode reads, where copies were added for it
    packed_weight_bytes: int = 0  # extra weight copies for batched GEMMs


@dataclass(frozen=True, slots=True)
class GraphSettings:
    """What :meth:`Platform.capture_graphs` may capture."""

    sizes: tuple[int, ...] | None  # batch sizes to capture; None: the platform's default; (): none
    attention_backend: str  # its name in the config, for the log
    max_num_seqs: int
    max_model_len: int
    block_size: int
    # The model and its KV caches (one per layer), for a platform that runs decode steps
    # itself (a native step) instead of replaying graphs of ``forward``.
    model: CausalLM | None = None
    kv_caches: tuple[torch.Tensor, ...] = ()


# One step's forward: (input_ids [T], meta) -> hidden states [T, hidden].
StepForward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


class Platform(ABC):
    """One device type's answers to what the core would otherwise ask with ``if device.type``:
    each rank's device, the compute dtype, the KV cache's memory, process tuning, when to compile,
    and how linears without a quantizer (and the LM head) keep and multiply their weights.

    Contract: one per rank, made as ``cls(device, options=)`` before anything is loaded. Every method
    runs at start-up, none per step (only the linear method's ``apply`` does), in this order:
    ``device_for_rank`` (a rank > 0's), ``prepare_process``, ``resolve_dtype``, ``linear_method`` (while
    the model is built on "meta"), ``finish_model`` (once its weights are loaded and its linears
    finished), ``available_memory``, ``shares_host_memory`` and ``pin_memory`` (the KV cache).
    Whatever ``finish_model`` adds lives on the layers the linear method multiplies (and only that
    method reads it: :func:`modserve.runner.linear.float_layers`): the model stays the same everywhere."""

    # The torch.distributed backend of this device's tensor-parallel collectives.
    distributed_backend: ClassVar[str] = "gloo"

    def __init__(self, device: torch.device, options: BaseModel | None = None) -> None:
        self.device = device
        self.options = options

    def device_for_rank(self, rank: int) -> torch.device:
        """Global rank ``rank`` > 0's device, rank 0's being this one. Default: this one, shared."""
        return self.device

    def shares_host_memory(self) -> bool:
        """The device computes in RAM: every rank's KV cache shares it, copies into it block. Default: no."""
        return False

    def pin_memory(self) -> bool:
        """The host swap space is pinned (page-locked) for faster copies to and from the device. Default: no."""
        return False

    def prepare_process(self) -> None:
        """Process-wide tuning before the model is loaded (the host allocator). Default: nothing."""

    def describe(self) -> str:
        """The hardware and the kernel routes it takes, for a benchmark's header. Default: the device."""
        return str(self.device)

    def auto_kv_cache_dtype(self, compute: torch.dtype, checkpoint: torch.dtype, dtype_setting: str) -> torch.dtype:
        """What ``kv_cache_dtype: auto`` stores, where the attention backend can read it (else the
        compute dtype). Default: the compute dtype."""
        return compute

    @abstractmethod
    def resolve_dtype(self, name: str, checkpoint: torch.dtype) -> torch.dtype:
        """The compute dtype for ``dtype: name``: that dtype, or for ``auto`` this device's
        choice for a checkpoint stored in ``checkpoint`` (logged, saying why)."""

    @abstractmethod
    def available_memory(self) -> int:
        """Bytes the device can allocate now; ``kv_cache_memory_fraction`` is a share of them."""

    def linear_method(self) -> Quantizer | None:
        """How linears without a quantizer, and the LM head, store and multiply their float
        weights: an :class:`~modserve.runner.linear.Unquantized` (subclass), or None for the
        runner's default, ``F.linear``."""
        return None

    def lora_kernel(self) -> LoRAKernel | None:
        """What adds LoRA adapters' updates to the linears' outputs (``enable_lora``), or None for
        the runner's torch reference (:class:`~modserve.runner.lora.TorchLoRAKernel`)."""
        return None

    @abstractmethod
    def finish_model(self, model: CausalLM, load: ModelLoad) -> FinishedModel:
        """Once, after loading: compile the model's regions or not (``load.compile``; see
        :func:`CausalLM.compile_regions`), and give the linear method's layers the weight
        copies it reads. A setting of ``on`` that cannot work here is a ``ValueError``
        saying why; an ``auto`` that stays off logs why."""

    def capture_graphs(self, forward: StepForward, backend: AttentionBackend,
                       settings: GraphSettings) -> StepForward:
        """Once the KV cache is allocated, on every rank: what runs a step's forward from now
        on. ``forward`` itself (the default: every step eager), or a replacement that replays
        graphs captured of ``forward`` for the steps they fit (no more than ``backend.cuda_graphs``
        allows) and calls ``forward`` for the others, giving the same hidden states."""
        return forward
