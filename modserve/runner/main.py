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
from modserve.core.contracts.executor import WorkerSpec
from modserve.core.registry import Registry
from modserve.runner.build import build_runner, prepare_rank
from modserve.runner.messages import Stop
from modserve.runner.parallel import collective_timeout, init_parallel


def run_worker(spec: WorkerSpec) -> None:
    """The life of rank ``spec.rank`` > 0: the driver's plugins and settings, its device, the
    group, its shard of the model; then every message rank 0 sends, until :class:`Stop`."""
    os.environ.update(spec.env)
    setup = prepare_rank(EngineConfig(**spec.config), plugin_registry(spec.plugins), spec.rank)
    tp, pp = init_parallel(spec.backend, spec.init_method, spec.rank, setup.config.tensor_parallel_size,
                           setup.config.pipeline_parallel_size, timeout=collective_timeout(setup.config.step_timeout))
    try:
        runner = build_runner(setup, tp, pp)
        while not isinstance(message := tp.broadcast(), Stop):
            runner.handle(on_device(message, runner.device))
        runner.close()
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
