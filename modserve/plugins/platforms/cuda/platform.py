"""The ``cuda`` platform: the checkpoint's dtype, the device's free memory, plain GEMMs
(cuBLAS through ``F.linear``: the default linear method), eager unless ``compile: on``."""

from __future__ import annotations

import logging

import torch
from pydantic import BaseModel

from modserve.api import CausalLM, FinishedModel, ModelLoad, Platform
from modserve.plugins.platforms.compile import compile_regions

logger = logging.getLogger("modserve")


class CudaPlatform(Platform):
    def __init__(self, device: torch.device, options: BaseModel | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"the cuda platform runs on a cuda device, not {device}")
        super().__init__(device, options)

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
        return FinishedModel(self.compile_wanted(load.compile, load.quantized) and compile_regions(model))

    def compile_wanted(self, setting: str, quantized: bool) -> bool:
        if setting != "auto":
            return setting == "on"
        if quantized:
            logger.info("compile auto: off (quantized linears run eagerly; set compile: on to try them compiled)")
        else:
            logger.info("compile auto: off (on %s the eager path is used; set compile: on to try it)",
                        self.device.type)
        return False
