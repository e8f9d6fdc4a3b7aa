"""The ``cpu`` platform: float32 activations, the glibc heap kept, and float weights in the
layouts and routes a CPU step reads fastest on the CPU at hand (:mod:`.features`,
:mod:`.linear`, :mod:`.prepack`), in huge pages (:mod:`.huge_pages`)."""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import BaseModel, Field

from modserve.api import (
    AttentionBackend, CausalLM, FinishedModel, GraphSettings, LoRAKernel, ModelLoad, Platform, StepForward,
    Unquantized, model_bytes)
from modserve.plugins.platforms.compile import AUTO_COMPILE_MIN_BYTES, compile_regions, compile_wanted
from modserve.plugins.platforms.cpu.host_memory import keep_freed_memory
from modserve.plugins.platforms.cpu.huge_pages import move_weights_to_huge_pages
from modserve.plugins.platforms.cpu.features import cpu_features
from modserve.plugins.platforms.cpu.lora import CppLoRAKernel, lora_kernel_problem
from modserve.plugins.platforms.cpu.linear import (
    CpuLinear, add_decode_weights, bf16_gemm_applies, bf16_gemm_wanted, decode_weight_dtype, to_bf16_weights)
from modserve.plugins.platforms.cpu.native_decode import native_decode_step
from modserve.plugins.platforms.cpu.prepack import add_bf16_packed_weights, add_packed_weights

logger = logging.getLogger("modserve")


class CpuOptions(BaseModel):
    native_decode: bool = Field(True, description="Run steps of decodes as one C++ call where the model, its "
                                "linears and the attention backend allow (false: the compiled forward)")
    huge_pages: bool = Field(True, description="Copy the weights into memory backed by 2 MiB transparent huge pages "
                             "(Linux): a decode step streams them with ~500x fewer TLB misses")
    bf16_gemm: Literal["auto", "on", "off"] = Field(
        "auto", description="With dtype auto and a bfloat16 checkpoint, keep the linears' weights and the KV cache "
        "in bfloat16 and multiply in bf16 with float32 sums (a dot kernel for 1-3 rows, oneDNN's bf16 GEMM on AMX "
        "tiles beyond); auto: on CPUs with AMX-BF16 (features.py)")
    lora_kernel: Literal["native", "torch"] = Field(
        "native", description="With enable_lora, what adds the adapters' updates: native, one C++ call per linear "
        "for all its adapters (csrc/lora.cpp; the torch reference where it cannot be built); torch, the reference")


class CpuPlatform(Platform):
    def __init__(self, device: torch.device, options: CpuOptions | None = None) -> None:
        if device.type != "cpu":
            raise ValueError(f"the cpu platform runs on device cpu, not {device}")
        super().__init__(device, options or CpuOptions())

    def shares_host_memory(self) -> bool:
        return True  # the KV cache is in RAM, beside every other rank's on this machine

    def prepare_process(self) -> None:
        keep_freed_memory()  # a step's activations reuse the last step's pages

    def describe(self) -> str:
        features = cpu_features()
        return f"cpu: {features.describe()}; bf16 checkpoints' linears: {self.bf16_route()}"

    def bf16_route(self) -> str:
        """Where dtype auto meets a bfloat16 checkpoint: ``bf16_gemm`` or ``few_rows`` (:mod:`.features`)."""
        setting = self.options.bf16_gemm
        return cpu_features().default_route() if setting == "auto" else ("bf16_gemm" if setting == "on" else "few_rows")

    def auto_kv_cache_dtype(self, compute: torch.dtype, checkpoint: torch.dtype, dtype_setting: str) -> torch.dtype:
        """bf16 under the bf16_gemm route (as vLLM's auto keeps a bf16 model's KV): half the bytes
        a decode step's attention reads, the values rounded as the linears' inputs are."""
        if bf16_gemm_applies(self.options.bf16_gemm, cpu_features(), dtype_setting, compute, checkpoint):
            return torch.bfloat16
        return compute

    def resolve_dtype(self, name: str, checkpoint: torch.dtype) -> torch.dtype:
        if name != "auto":
            return getattr(torch, name)
        if checkpoint != torch.float32:
            # The linears may still multiply in bf16 (the bf16_gemm route, decided in finish_model).
            logger.info("dtype auto: float32 activations (checkpoint is %s)", checkpoint)
            return torch.float32
        logger.info("dtype auto: %s (the checkpoint's)", checkpoint)
        return checkpoint

    def available_memory(self) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot read available memory from /proc/meminfo; set kv_cache_memory_gb")

    def linear_method(self) -> Unquantized:
        return CpuLinear()

    def lora_kernel(self) -> LoRAKernel | None:
        """The C++ kernel (:mod:`.lora`) unless told otherwise or it cannot be built; else the reference."""
        problem = "lora_kernel: torch" if self.options.lora_kernel == "torch" else lora_kernel_problem()
        if problem is None:
            logger.info("LoRA kernel: C++ (csrc/lora.cpp)")
            return CppLoRAKernel()
        logger.info("LoRA kernel: the torch reference (%s)", problem if self.options.lora_kernel == "torch"
                    else f"the C++ kernel cannot be built: {problem}")
        return None

    def finish_model(self, model: CausalLM, load: ModelLoad) -> FinishedModel:
        compiled = (self.compile_wanted(load.compile, model_bytes(model), load.quantized, load.quantizer_traceable)
                    and compile_regions(model))
        packed_bytes = 0
        if bf16_gemm_wanted(self.options.bf16_gemm, cpu_features(), load.dtype_setting, load.dtype,
                            load.checkpoint_dtype):
            decode_bytes: int | None = to_bf16_weights(model)
            # float32 activations: the packing rules of float32 models, for bf16 copies
            if self.prepack_wanted(load.prepack_weights, torch.float32, decode_bytes, load.quantized):
                packed_bytes = add_bf16_packed_weights(model)
        else:
            decode_dtype = decode_weight_dtype(load.dtype_setting, load.dtype, load.checkpoint_dtype, compiled)
            decode_bytes = add_decode_weights(model, decode_dtype) if decode_dtype is not None else None
            if self.prepack_wanted(load.prepack_weights, load.dtype, model_bytes(model), load.quantized):
                packed_bytes = add_packed_weights(model)
            elif decode_dtype is not None:
                logger.info("prepack_weights off: the linears keep float32 weights beside their %s decode copies "
                            "(batches multiply them unpacked)", str(decode_dtype).removeprefix("torch."))
        if self.options.huge_pages:
            self._move_to_huge_pages(model)
        return FinishedModel(compiled, decode_bytes, packed_bytes)

    def capture_graphs(self, forward: StepForward, backend: AttentionBackend,
                       settings: GraphSettings) -> StepForward:
        """No graphs on a CPU: the native decode step where it runs (:mod:`.native_decode`)."""
        if not self.options.native_decode:
            return forward
        return native_decode_step(forward, backend, settings) or forward

    def compile_wanted(self, setting: str, weight_bytes: int, quantized: bool, traceable: bool = False) -> bool:
        return compile_wanted(setting, weight_bytes, quantized, traceable)

    def prepack_wanted(self, setting: str, dtype: torch.dtype, weight_bytes: int, quantized: bool) -> bool:
        """Whether to pack; ``on`` where packing cannot work is an error, ``auto`` logs why not."""
        problem = None
        if dtype != torch.float32:
            problem = f"packed GEMMs are float32; this model computes in {str(dtype).removeprefix('torch.')}"
        elif quantized:
            problem = "a quantizer owns the linears' weights"
        elif not torch.backends.mkldnn.is_available():
            problem = "this torch build has no oneDNN (mkldnn)"
        if setting == "on" and problem:
            raise ValueError(f"prepack_weights: on, but {problem}")
        if setting != "auto":
            return setting == "on"
        if problem is None and weight_bytes < AUTO_COMPILE_MIN_BYTES:
            problem = f"{weight_bytes / 2**20:.0f} MiB of weights, below the {AUTO_COMPILE_MIN_BYTES >> 20} MiB of auto"
        if problem:
            logger.info("prepack_weights auto: off (%s)", problem)
        return problem is None

    @staticmethod
    def _move_to_huge_pages(model: CausalLM) -> None:
        moved = move_weights_to_huge_pages(model)
        if moved.problem:
            logger.info("huge pages: off (%s; %.0f MiB moved before)", moved.problem, moved.moved_bytes / 2**20)
            return
        logger.info("huge pages: %.0f MiB of weights copied into huge-page memory in %.2f s, %.0f MiB of it in "
                    "2 MiB pages%s", moved.moved_bytes / 2**20, moved.seconds, moved.huge_bytes / 2**20,
                    "" if moved.huge_bytes else " (transparent huge pages are off on this machine: "
                    "/sys/kernel/mm/transparent_hugepage/enabled)")
