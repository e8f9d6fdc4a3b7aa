"""The life of a tensor-parallel rank > 0, for executors to run in the processes they start.

An executor plugin calls :func:`run_worker` with each :class:`~modserve.api.WorkerSpec`
(in a spawned process, a Ray actor, ...); it returns when rank 0 stops the engine.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any

import torch
import torch.distributed as dist

from modserve.core.config import EngineConfig
from modserve.runner.loader import resolve_max_model_len
from modserve.core.contracts.platform import Platform
from modserve.core.contracts.executor import WorkerSpec
from modserve.runner.loader import checkpoint_dtype, load_hf_config
from modserve.runner.model_runner import ModelRunner
from modserve.runner.parallel import init_parallel
from modserve.core.registry import Registry
from modserve.runner.ranks import STOP


def run_worker(spec: WorkerSpec) -> None:
    """The life of rank ``spec.rank`` > 0: the driver's plugins and settings, the group, its
    shard of the model; then every call rank 0 sends, until it sends ``stop``."""
    os.environ.update(spec.env)
    config = EngineConfig(**spec.config)
    if config.device.startswith("cuda") and ":" not in config.device:
        config.device = f"cuda:{spec.rank}"  # one device per rank
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    registry = plugin_registry(spec.plugins)
    platform: Platform = registry.create("platform", config.platform_choice(), torch.device(config.device))
    platform.prepare_process()
    torch.manual_seed(config.seed)
    tp, pp = init_parallel(spec.backend, spec.init_method, spec.rank, config.tensor_parallel_size,
                           config.pipeline_parallel_size)
    try:
        hf_config = load_hf_config(config.model)
        dtype = platform.resolve_dtype(config.dtype, checkpoint_dtype(hf_config))
        runner = ModelRunner(config, hf_config, registry, dtype, resolve_max_model_len(config, hf_config), set(),
                             progress=False, platform=platform, tp=tp, pp=pp)
        while True:
            method, args = tp.broadcast()
            if method == STOP:
                runner.close()
                break
            getattr(runner, method)(*on_device(args, runner.device))
    finally:
        dist.destroy_process_group()


def on_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors (in lists, tuples and dataclasses such as the attention
    metadata) on this rank's device: rank 0's arrive on the device rank 0 put them on."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_device(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: on_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def plugin_registry(sources: list[str]) -> Registry:
    """A registry of the plugins the driver loaded: its distributions' entry points, and the
    modules it registered directly (``module:NAME``)."""
    registry = Registry()
    registry.load_entrypoints(allow={s for s in sources if not s.startswith("module:")})
    for source in sources:
        if source.startswith("module:"):
            name = source.removeprefix("module:")
            registry.add_plugin(importlib.import_module(name), name)
    return registry
