"""A rank's runner, made the same way on rank 0 (the engine's process) and on every other rank.

Two steps, as rank 0 starts the other ranks between them: :func:`prepare_rank` (the
platform, the process's settings, the checkpoint's config: what the ranks are started
with), then :func:`build_runner` once the rank has joined the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from modserve.core.config import EngineConfig
from modserve.core.contracts.platform import Platform
from modserve.core.registry import Registry
from modserve.runner.loader import checkpoint_dtype, load_hf_config, resolve_max_model_len
from modserve.runner.model_runner import ModelRunner
from modserve.runner.parallel import PipelineStage, TensorParallel
from modserve.runner.pooling import as_pooling_model


@dataclass(frozen=True, slots=True)
class RankSetup:
    """What a rank settles before it loads its shard of the model."""

    config: EngineConfig  # its device is this rank's
    registry: Registry
    platform: Platform
    hf_config: Any  # the checkpoint's config.json (transformers' PretrainedConfig)
    dtype: torch.dtype  # the compute dtype
    max_model_len: int


def prepare_rank(config: EngineConfig, registry: Registry, rank: int = 0) -> RankSetup:
    """Global rank ``rank``'s platform on its device (with the process tuned for it), the
    seeded global generator, the checkpoint's config, the context length and the dtype.
    A ``ValueError`` for a config that cannot be, before any rank loads weights."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    platform: Platform = registry.create("platform", config.platform_choice(), torch.device(config.device))
    if rank and (device := platform.device_for_rank(rank)) != platform.device:
        # NOTE: a platform is made for one device, so this rank makes its own; the config
        # names that device too, for whatever on this rank reads it.
        config = config.model_copy(update={"device": str(device)})
        platform = registry.create("platform", config.platform_choice(), device)
    platform.prepare_process()
    torch.manual_seed(config.seed)  # unseeded requests draw from the global generator
    hf_config = load_hf_config(config.model)
    if config.runner == "pooling":
        as_pooling_model(hf_config)
    max_model_len = resolve_max_model_len(config, hf_config)
    # A partition that cannot be is the config's fault: say so before any worker starts.
    PipelineStage(0, config.pipeline_parallel_size).layers(hf_config.num_hidden_layers, config.pp_layer_partition)
    dtype = platform.resolve_dtype(config.dtype, checkpoint_dtype(hf_config))
    return RankSetup(config, registry, platform, hf_config, dtype, max_model_len)


def build_runner(setup: RankSetup, tp: TensorParallel = TensorParallel(), pp: PipelineStage = PipelineStage(),
                 eos_token_ids: Iterable[int] = (), progress: bool = False) -> ModelRunner:
    """The rank's runner, its shard of the model loaded: tensor-parallel rank ``tp.rank`` of
    pipeline stage ``pp.index``. Rank 0 passes the EOS ids (its sampler bans them under
    ``min_tokens``); the other ranks never sample."""
    return ModelRunner(setup.config, setup.hf_config, setup.registry, setup.dtype, setup.max_model_len,
                       set(eos_token_ids), progress=progress, platform=setup.platform, tp=tp, pp=pp)
