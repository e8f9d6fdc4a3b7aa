"""The ``cuda`` platform: the checkpoint's dtype, the device's free memory, plain GEMMs
(cuBLAS through ``F.linear``: the default linear method), compiled layers for unquantized
models of 64 MiB or more, CUDA graphs for decode steps where the attention backend allows them."""

from __future__ import annotations

import logging

import torch
from pydantic import BaseModel

from modserve.api import (AttentionBackend, CausalLM, FinishedModel, GraphSettings, LoRAKernel, ModelLoad,
                          Platform, StepForward, model_bytes)
from modserve.plugins.platforms.compile import compile_regions, compile_wanted
from modserve.plugins.platforms.cuda.graphs import CudaGraphRecorder, capture_decode_graphs

logger = logging.getLogger("modserve")


class CudaPlatform(Platform):
    def __init__(self, device: torch.device, options: BaseModel | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"the cuda platform runs on a cuda device, not {device}")
        super().__init__(device, options)

    def device_for_rank(self, rank: int) -> torch.device:
        """``cuda:{rank}``, one GPU per rank; all on the one GPU a device with an index names."""
        return self.device if self.device.index is not None else torch.device("cuda", rank)

    def pin_memory(self) -> bool:
        return True  # swaps then copy straight between page-locked RAM and the GPU

    def resolve_dtype(self, name: str, checkpoint: torch.dtype) -> torch.dtype:
        if name != "auto":
            return getattr(torch, name)
        logger.info("dtype auto: %s (the checkpoint's)", checkpoint)
        return checkpoint

    def available_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def finish_model(self, model: CausalLM, load: ModelLoad) -> FinishedModel:
        problem = f"packed weights are for CPU GEMMs, not {self.device.type}"
        if load.prepack_weights == "on":
            raise ValueError(f"prepack_weights: on, but {problem}")
        if load.prepack_weights == "auto":
            logger.info("prepack_weights auto: off (%s)", problem)
        wanted = self.compile_wanted(load.compile, model_bytes(model), load.quantized, load.quantizer_traceable)
        return FinishedModel(wanted and compile_regions(model))

    def compile_wanted(self, setting: str, weight_bytes: int, quantized: bool, traceable: bool = False) -> bool:
        return compile_wanted(setting, weight_bytes, quantized, traceable)

    def lora_kernel(self) -> LoRAKernel | None:
        """The Triton shrink and expand (:mod:`.lora_triton`) where triton imports; else the reference."""
        try:
            from modserve.plugins.platforms.cuda.lora_triton import TritonLoRAKernel

            return TritonLoRAKernel()
        except (ImportError, ValueError) as e:
            logger.info("LoRA kernel: the torch reference (%s)", e)
            return None

    def capture_graphs(self, forward: StepForward, backend: AttentionBackend,
                       settings: GraphSettings) -> StepForward:
        return capture_decode_graphs(forward, backend, settings, self.device, CudaGraphRecorder(self.device))
